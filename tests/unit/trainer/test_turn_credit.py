"""Per-turn credit for multi-turn episodes (trainer.turn_credit): each model turn is baselined
against the same turn of its group, against numbers worked out by hand; the trajectory field
that carries the turns' rewards survives the wire and is checked on arrival."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.services.protocol import decode, encode
from tandem.trainer.advantages import model_turns
from tandem.trainer.batch import Shaping, StepBatch, plan_step
from tandem.trainer.buffer import Group, validate


def test_model_turns_are_the_runs_of_mask_one():
    mask = np.array([1, 1, 0, 0, 1, 0, 1, 1], np.uint8)
    assert model_turns(mask, 8).tolist() == [0, 0, -1, -1, 1, -1, 2, 2]
    assert model_turns(None, 3).tolist() == [0, 0, 0]
    assert model_turns(np.array([1, 1], np.uint8), 2).tolist() == [0, 0]


def _episode(traj, i, mask, turn_rewards):
    t = traj("g", i, group_size=3, out_len=len(mask), seed=i, reward=float(turn_rewards[-1]))
    t.output_mask = np.asarray(mask, np.uint8)
    t.turn_rewards = np.asarray(turn_rewards, np.float32)
    assert validate(t) is None
    return t


@pytest.fixture
def group(traj):
    """Sample 0 right at once; sample 1 wrong, then right after feedback; sample 2 wrong twice."""
    return StepBatch.from_groups([Group("g", 0, 0, [
        _episode(traj, 0, [1, 1, 1], [1.0]),
        _episode(traj, 1, [1, 1, 0, 1, 1], [-1.0, 1.0]),
        _episode(traj, 2, [1, 0, 1, 1, 1], [-1.0, -1.0]),
    ])])


def _tokens(plan, batch):
    (mb,) = plan.minibatches[0].micro_batches
    adv, out = mb.fields["advantages"], {}
    for k, i in enumerate(mb.seq_index):
        start = int(mb.cu_seqlens[k]) + len(batch.prompt_ids[i])
        out[i] = adv[start:int(mb.cu_seqlens[k + 1])].tolist()
    return out


def test_each_turn_is_baselined_on_the_same_turn_of_its_group(group):
    # turn 0: rewards 1, -1, -1 (mean -1/3) -> 4/3, -2/3, -2/3
    # turn 1: only samples 1 and 2 got there: 1, -1 (mean 0) -> 1, -1; environment tokens 0
    plan = plan_step(group, 1, 1000, 1, 0, group_baseline=True, normalize=False)
    tokens = _tokens(plan, group)
    assert tokens[0] == pytest.approx([4 / 3] * 3)
    assert tokens[1] == pytest.approx([-2 / 3, -2 / 3, 0, 1, 1])
    assert tokens[2] == pytest.approx([-2 / 3, 0, -1, -1, -1])
    # the per-sequence figure is the mean over the sequence's model tokens
    assert plan.advantages.tolist() == pytest.approx([4 / 3, (-4 / 3 + 2) / 4, (-2 / 3 - 3) / 4])


def test_episode_credit_gives_the_rescued_first_program_the_episode_reward(group):
    # rewards 1, 1, -1 (mean 1/3): sample 1's wrong first program gets +2/3 like its fix
    plan = plan_step(group, 1, 1000, 1, 0, True, False, Shaping(turn_credit=False))
    tokens = _tokens(plan, group)
    assert tokens[1] == pytest.approx([2 / 3, 2 / 3, 0, 2 / 3, 2 / 3])
    assert tokens[2] == pytest.approx([-4 / 3, 0, -4 / 3, -4 / 3, -4 / 3])


def test_normalisation_is_over_model_tokens_only(group):
    plan = plan_step(group, 1, 1000, 1, 0, group_baseline=True, normalize=True)
    values = np.concatenate([a[m] for a, m in zip(plan.token_advantages, group.loss_masks, strict=True)])
    assert len(values) == plan.minibatches[0].n_valid == 11
    assert values.mean() == pytest.approx(0, abs=1e-9)
    assert values.std(ddof=1) == pytest.approx(1, rel=1e-4)     # the sample std (adv_norm_std)


def test_a_lone_revision_is_its_own_baseline(traj):
    batch = StepBatch.from_groups([Group("g", 0, 0, [
        _episode(traj, 0, [1, 1], [1.0]),
        _episode(traj, 1, [1, 0, 1], [-1.0, 1.0]),
        _episode(traj, 2, [1, 1], [1.0]),
    ])])
    tokens = _tokens(plan_step(batch, 1, 1000, 1, 0, True, False), batch)
    assert tokens[1] == pytest.approx([-4 / 3, 0, 0])   # nothing to compare its fix with


def test_the_overlong_penalty_reaches_every_turn(traj):
    batch = StepBatch.from_groups([Group("g", 0, 0, [
        _episode(traj, 0, [1, 1, 0, 1, 1, 1], [-1.0, 1.0]),
        _episode(traj, 1, [1, 0, 1], [-1.0, 1.0]),
        _episode(traj, 2, [1], [1.0]),
    ])])
    # L = 6, B = 2: sample 0 (6 tokens) loses 2 on each turn, the others nothing
    sh = Shaping(overlong_buffer=2, overlong_max_len=6, overlong_penalty=2.0)
    tokens = _tokens(plan_step(batch, 1, 1000, 1, 0, True, False, sh), batch)
    # turn 0: -3, -1, 1 (mean -1) -> -2, 0, 2; turn 1: -1, 1 (mean 0) -> -1, 1
    assert tokens[0] == pytest.approx([-2, -2, 0, -1, -1, -1])
    assert tokens[1] == pytest.approx([0, 0, 1])
    assert tokens[2] == pytest.approx([2])


def test_turn_rewards_travel_and_must_fit_the_turns(traj):
    t = _episode(traj, 1, [1, 1, 0, 1, 1], [-1.0, 0.5])
    back = decode(encode(t)).body
    assert back.turn_rewards.tolist() == [-1.0, 0.5] and back.turn_rewards.dtype == np.float32
    t.turn_rewards = np.array([1.0], np.float32)
    assert validate(t) == "1 turn_rewards for 2 model turns (runs of output_mask 1)"
    t.turn_rewards = np.array([1.0, np.nan], np.float32)
    assert validate(t) == "non-finite turn reward"
    t.output_mask, t.turn_rewards = None, np.array([1.0], np.float32)   # no mask: one turn
    assert validate(t) is None
