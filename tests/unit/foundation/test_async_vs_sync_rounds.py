"""benchmarks/async_vs_sync.py's rounds (`--repeats N`), without its runs (half an hour each):
how one variant's rounds become one result, and a bad count refused before anything starts."""
from __future__ import annotations

import pytest

from benchmarks import async_vs_sync as bench


def _round(s_per_step: float, staleness: int, accuracy: float | None, eval_n: int) -> dict:
    return {"s_per_step": s_per_step, "staleness_max": staleness, "accuracy_before": accuracy,
            "accuracy_after": accuracy, "eval_n": eval_n, "role_cpu_s": {"trainer": s_per_step},
            "train_us_per_token": 10 * s_per_step}


def test_rounds_become_medians_with_the_worst_staleness_and_the_first_rounds_accuracy():
    rounds = [_round(2.0, 3, 0.5, 300), _round(3.0, 4, None, 0), _round(2.2, 2, None, 0)]
    out = bench.median_of_rounds(rounds)
    assert out["s_per_step"] == 2.2 and out["train_us_per_token"] == pytest.approx(22.0)
    assert out["staleness_max"] == 4
    # measured in the first round only: a median would report eval_n 0 and no accuracy
    assert (out["accuracy_after"], out["eval_n"]) == (0.5, 300)
    assert out["role_cpu_s"] == {"trainer": 2.0}
    assert out["s_per_step_rounds"] == [2.0, 3.0, 2.2]
    assert out["s_per_step_spread"] == pytest.approx((3.0 - 2.0) / 2.2)


def test_one_round_is_reported_as_it_was_measured():
    one = _round(2.0, 3, 0.5, 300)
    assert bench.median_of_rounds([one]) == one


def test_a_count_below_one_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        bench.main(repeats=0)
