"""Advantage variants (RLOO, GRPO's group std, Dr. GRPO's none) and data shaping (DAPO's soft
overlong penalty, masking truncated samples) against numbers worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.trainer.advantages import sequence_advantages
from tandem.trainer.batch import Shaping, StepBatch, plan_step
from tandem.trainer.shaping import keep_samples, overlong_penalty


def test_leave_one_out_baseline():
    # group a: rewards 5, -5, -5 -> b_0 = (-5 - 5)/2 = -5, b_1 = b_2 = (5 - 5)/2 = 0
    # group b: one sample -> no other sample: advantage 0
    adv = sequence_advantages([5, -5, -5, 3], ["a", "a", "a", "b"], [1] * 4, group_baseline=True,
                              normalize=False, leave_one_out=True)
    assert adv.tolist() == pytest.approx([10, -5, -5, 0])


def test_group_std_normalisation_as_grpo():
    # group a: 1, 0, 0, 0: mean 1/4, sample std sqrt(((3/4)^2 + 3 (1/4)^2) / 3) = sqrt(0.25) = 0.5
    # group b: 2, 2: std 0 -> (2 - 2) / (0 + eps) = 0
    adv = sequence_advantages([1, 0, 0, 0, 2, 2], list("aaaabb"), [3, 1, 2, 9, 1, 1], group_baseline=True,
                              normalize=True, norm_scope="group", eps=1e-12)
    assert adv.tolist() == pytest.approx([0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5, 0, 0])


def test_dr_grpo_no_std_normalisation():
    adv = sequence_advantages([1, 0, 0, 0], list("aaaa"), [1] * 4, group_baseline=True, normalize=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_soft_overlong_penalty_by_hand():
    # L = 100, B = 20: no penalty up to 80; linear to -factor at 100; -factor beyond
    pen = overlong_penalty([50, 80, 85, 90, 100, 130], max_len=100, buffer=20, factor=5.0)
    assert pen.tolist() == pytest.approx([0, 0, -5 * 5 / 20, -5 * 10 / 20, -5.0, -5.0])
    assert overlong_penalty([500], 100, 0, 5.0).tolist() == [0.0]    # buffer 0: off


def test_truncated_samples_are_the_ones_without_eos():
    assert keep_samples(["stop", "length", "stop"], True).tolist() == [True, False, True]
    assert keep_samples(["stop", "length"], False).tolist() == [True, True]


def test_plan_applies_the_penalty_before_advantages_and_masks_truncated(traj):
    from tandem.trainer.buffer import Group
    # one group of two samples: rewards 5 and 5, lengths 4 and 10; L = 10, B = 5
    a = traj("g", 0, out_len=4, reward=5.0)
    b = traj("g", 1, out_len=10, reward=5.0)
    b.finish_reason = "length"
    batch = StepBatch.from_groups([Group("g", 0, 0, [a, b])])
    sh = Shaping(overlong_buffer=5, overlong_max_len=10, overlong_penalty=2.0, mask_truncated=True)
    plan = plan_step(batch, 1, 1000, 1, 0, True, False, sh)
    # penalties: 4 <= 5 -> 0; 10 = L -> -2. Rewards 5, 3; group mean 4: advantages +1, -1
    assert plan.advantages.tolist() == pytest.approx([1.0, -1.0])
    assert plan.shaping == {"overlong_penalty_mean": -1.0, "truncated_samples": 1}
    (mb,) = plan.minibatches[0].micro_batches
    keep = mb.fields["sample_mask"].numpy()
    lens = [len(a.prompt_ids) + 4, len(b.prompt_ids) + 10]
    assert keep.tolist() == [True] * lens[0] + [False] * lens[1]
    assert math.isclose(plan.minibatches[0].n_valid, 14)   # the masked sample still counts
    assert np.all(mb.fields["loss_mask"].numpy().sum() == 14)
