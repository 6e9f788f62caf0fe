"""The figure a multi-seed training benchmark reports (benchmarks/train_math.py, `seed_means`):
the mean gain over seeds and a standard error built from each evaluation's binomial error —
checked against numbers worked out by hand, since docs quote it as the evidence of learning."""
from __future__ import annotations

import pytest

from benchmarks.train_math import seed_means


def _run(before, after, first_before=None, first_after=None, n=100):
    r = {"eval_n": n, "accuracy_before": before, "accuracy_after": after}
    if first_before is not None:
        r.update(first_turn_before_accuracy=first_before, first_turn_after_accuracy=first_after)
    return r


def test_mean_gain_and_its_standard_error():
    # gains 20 and 10 points; variance (.21 + .25 + .24 + .25) / 100, halved in s.e. for two seeds
    m = seed_means([_run(0.3, 0.5), _run(0.4, 0.5)])
    assert m == {"seeds_gain_points": 15.0, "seeds_gain_se_points": pytest.approx(4.9)}


def test_first_turn_gain_only_when_every_run_has_one():
    both = seed_means([_run(0.3, 0.5, 0.2, 0.4), _run(0.4, 0.5, 0.3, 0.3)])
    assert both["seeds_first_turn_gain_points"] == 10.0
    assert both["seeds_first_turn_gain_se_points"] == pytest.approx(4.5)   # (.16+.24+.21+.21)/100
    assert "seeds_first_turn_gain_points" not in seed_means([_run(0.3, 0.5, 0.2, 0.4), _run(0.4, 0.5)])
