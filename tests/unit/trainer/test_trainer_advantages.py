"""Advantages against values computed by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.trainer.advantages import sequence_advantages


def test_group_baseline_subtracts_each_groups_mean():
    adv = sequence_advantages([5, -5, -5, 5, 5, 5], ["a", "a", "a", "b", "b", "b"], [1] * 6,
                              group_baseline=True, normalize=False)
    # group a: mean -5/3; group b: mean 5 (all equal -> no signal)
    assert adv.tolist() == pytest.approx([20 / 3, -10 / 3, -10 / 3, 0, 0, 0])


def test_no_baseline_keeps_rewards():
    adv = sequence_advantages([5, -5, 1], ["a", "a", "b"], [3, 3, 3], group_baseline=False, normalize=False)
    assert adv.tolist() == [5, -5, 1]


@pytest.mark.parametrize("std, ddof", [("population", 0), ("sample", 1)])
def test_normalisation_is_over_tokens_of_the_global_batch(std, ddof):
    # rewards 1, 0 (group a) and 3 (group b); no baseline; lengths 1, 3, 2 tokens
    adv = sequence_advantages([1, 0, 3], ["a", "a", "b"], [1, 3, 2], group_baseline=False, normalize=True,
                              eps=0.0, std=std)
    tokens = [1, 0, 0, 0, 3, 3]                     # the rewards broadcast to tokens, by hand
    mean = sum(tokens) / 6                          # 7/6
    sd = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (6 - ddof))
    assert adv.tolist() == pytest.approx([(1 - mean) / sd, (0 - mean) / sd, (3 - mean) / sd])
    per_token = np.repeat(adv, [1, 3, 2])
    assert per_token.mean() == pytest.approx(0, abs=1e-12)
    assert per_token.std(ddof=ddof) == pytest.approx(1, abs=1e-12)


def test_baseline_then_normalisation():
    adv = sequence_advantages([5, -5, 5, 5], ["a", "a", "b", "b"], [2, 2, 2, 2], group_baseline=True,
                              normalize=True, eps=0.0, std="population")
    # after baseline: 5, -5, 0, 0; token mean 0; token std sqrt((25+25)/4)
    s = math.sqrt(50 / 4)
    assert adv.tolist() == pytest.approx([5 / s, -5 / s, 0, 0])
    # the sample std over the 8 tokens: sqrt(4 * 25 / 7); the default
    adv = sequence_advantages([5, -5, 5, 5], ["a", "a", "b", "b"], [2, 2, 2, 2], group_baseline=True,
                              normalize=True, eps=0.0)
    s = math.sqrt(100 / 7)
    assert adv.tolist() == pytest.approx([5 / s, -5 / s, 0, 0])


def test_zero_spread_is_centred_not_divided():
    adv = sequence_advantages([5, 5, 5], ["a", "b", "c"], [2, 2, 2], group_baseline=False, normalize=True)
    assert adv.tolist() == [0, 0, 0]


def test_mismatched_lengths_name_the_problem():
    with pytest.raises(ValueError, match="one entry per sequence"):
        sequence_advantages([1, 2], ["a"], [1, 1])
