"""Replay buffer: complete groups only, oldest admit_version first, exactly once, persistent."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tandem.trainer.buffer import ReplayBuffer


def fill(buf, traj, groups):
    """groups: [(group_id, admit_version, group_size)]; samples arrive interleaved."""
    longest = max(n for _, _, n in groups)
    for k in range(longest):
        for gid, v, n in groups:
            if k < n:
                assert buf.add(traj(gid, k, group_size=n, admit_version=v, seed=k))


def test_only_complete_groups_are_taken(traj):
    buf = ReplayBuffer()
    buf.add(traj("a", 0, group_size=3))
    buf.add(traj("a", 2, group_size=3))
    assert buf.n_ready == 0 and buf.n_partial == 1
    assert buf.take(1, version=0, max_staleness=4).groups == []
    buf.add(traj("a", 1, group_size=3))
    res = buf.take(1, version=0, max_staleness=4)
    assert [g.group_id for g in res.groups] == ["a"]
    assert [t.sample_idx for t in res.groups[0].samples] == [0, 1, 2]


def test_oldest_admit_version_first_then_completion_order(traj):
    buf = ReplayBuffer()
    # completion order: c (v2), a (v1), d (v1), b (v0)
    fill(buf, traj, [("c", 2, 1)])
    fill(buf, traj, [("a", 1, 2)])
    fill(buf, traj, [("d", 1, 2)])
    fill(buf, traj, [("b", 0, 3)])
    assert buf.peek_order() == ["b", "a", "d", "c"]
    assert [g.group_id for g in buf.take(2, 2, 4).groups] == ["b", "a"]
    assert [g.group_id for g in buf.take(2, 2, 4).groups] == ["d", "c"]


def test_not_enough_groups_takes_nothing(traj):
    buf = ReplayBuffer()
    fill(buf, traj, [("a", 0, 2)])
    assert buf.take(2, 0, 4).groups == []
    assert buf.n_ready == 1


def test_exactly_once_duplicates_and_late_samples_are_refused(traj):
    buf = ReplayBuffer()
    assert buf.add(traj("a", 0, group_size=2))
    assert not buf.add(traj("a", 0, group_size=2))          # duplicate push
    assert buf.add(traj("a", 1, group_size=2))
    assert not buf.add(traj("a", 1, group_size=2))          # duplicate after completion
    assert len(buf.take(1, 0, 4).groups) == 1
    assert not buf.add(traj("a", 0, group_size=2))          # late copy of a trained group
    assert buf.take(1, 0, 4).groups == []
    assert buf.counters["rejected_duplicate"] == 1
    assert buf.counters["rejected_late_duplicate"] == 2


def test_invalid_trajectories_are_refused_and_counted(traj):
    buf = ReplayBuffer()
    bad = traj("a", 0, out_len=3)
    bad.output_logprobs = np.zeros(2, np.float32)
    assert not buf.add(bad)
    assert not buf.add(traj("b", 5, group_size=2))           # sample_idx out of range
    assert buf.add(traj("c", 0, group_size=2, admit_version=1))
    assert not buf.add(traj("c", 1, group_size=3, admit_version=1))   # disagrees with its group
    nan = traj("d", 0, group_size=1)
    nan.reward = float("nan")
    assert not buf.add(nan)
    assert buf.counters["rejected_invalid"] == 4


def test_an_invalid_sample_refuses_its_group_which_waits_to_give_its_slot_back(traj):
    """A group trains only whole, so one non-finite log-prob refuses the group: the samples
    already here go, later ones are refused, and the trainer learns which groups to release at
    the controller (with why) — once, and across a checkpoint."""
    buf = ReplayBuffer()
    assert buf.add(traj("a", 0, group_size=3))
    bad = traj("a", 1, group_size=3)
    bad.output_logprobs[0] = float("nan")
    assert not buf.add(bad)
    assert not buf.add(traj("a", 2, group_size=3))           # the rest of a refused group
    assert buf.n_partial == 0 and buf.n_ready == 0
    fill(buf, traj, [("b", 0, 1)])
    restored = ReplayBuffer()
    restored.load_state_dict(buf.state_dict())
    assert restored.take_refused() == {"a": "non-finite behaviour log-prob"}
    assert restored.take_refused() == {}
    assert buf.take_refused() == {"a": "non-finite behaviour log-prob"}
    # What holds an admission slot: trained + ready, not the refused group.
    buf.take(1, 0, 4)
    assert (buf.n_trained, buf.n_ready, buf.n_consumed) == (1, 0, 2)


@pytest.mark.parametrize("policy", ["train", "drop"])
def test_over_stale_groups_are_trained_or_dropped_and_counted(traj, policy):
    buf = ReplayBuffer()
    fill(buf, traj, [("old", 0, 1), ("mid", 3, 1), ("new", 5, 1)])
    res = buf.take(2, version=5, max_staleness=2, stale_policy=policy)
    if policy == "train":
        assert [g.group_id for g in res.groups] == ["old", "mid"]
        assert res.over_stale_trained == 1 and buf.counters["trained_over_stale"] == 1
    else:
        assert [g.group_id for g in res.dropped] == ["old"]
        assert [g.group_id for g in res.groups] == ["mid", "new"]
        assert buf.counters["dropped_stale"] == 1
        assert not buf.add(traj("old", 0, group_size=1))   # a dropped group is done too


def test_state_survives_a_restart_through_torch_save(traj):
    buf = ReplayBuffer()
    fill(buf, traj, [("a", 1, 2), ("b", 0, 2), ("c", 2, 2)])
    buf.add(traj("p", 0, group_size=3, admit_version=2))    # partial group
    first = buf.take(1, 2, 4).groups[0]
    assert first.group_id == "b"
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    restored = ReplayBuffer()
    restored.load_state_dict(torch.load(f, weights_only=True))
    assert restored.peek_order() == buf.peek_order() == ["a", "c"]
    assert restored.n_partial == 1 and restored.counters == buf.counters
    assert not restored.add(traj("b", 0, group_size=2))       # consumed before the restart
    restored.add(traj("p", 1, group_size=3, admit_version=2))
    restored.add(traj("p", 2, group_size=3, admit_version=2))
    got = [g for _ in range(3) for g in restored.take(1, 2, 4).groups]
    assert [g.group_id for g in got] == ["a", "c", "p"]
    a0 = got[0].samples[0]
    orig = traj("a", 0, group_size=2, admit_version=1, seed=0)
    assert np.array_equal(a0.output_ids, orig.output_ids)
    assert np.array_equal(a0.output_logprobs, orig.output_logprobs) and a0.reward == orig.reward


def test_min_output_version_for_token_staleness(traj):
    buf = ReplayBuffer()
    buf.add(traj("a", 0, group_size=2, admit_version=3, out_len=3, versions=[3, 4, 5]))
    buf.add(traj("a", 1, group_size=2, admit_version=3, out_len=2, versions=[4, 4]))
    assert buf.take(1, 5, 4).groups[0].min_output_version() == 3


def test_a_resume_discards_groups_admitted_past_its_checkpoint(traj):
    """Logged after the checkpoint by a launch that went further: generated by policies no
    longer in the run's history. Ready and partial ones go; later samples of them are refused."""
    buf = ReplayBuffer()
    fill(buf, traj, [("old", 1, 2), ("future", 4, 2)])
    assert buf.add(traj("half-future", 0, group_size=2, admit_version=5))
    assert buf.discard_future(version=2) == ["future", "half-future"]
    assert buf.peek_order() == ["old"] and buf.n_partial == 0
    assert not buf.add(traj("half-future", 1, group_size=2, admit_version=5))
    assert buf.counters["discarded_future"] == 2


def _keyed(traj, gid, k, key, n=2, v=0):
    t = traj(gid, k, group_size=n, admit_version=v)
    t.prompt_key = key
    return t


def test_one_group_per_prompt_the_second_is_refused_and_gives_its_slot_back(traj):
    """A worker killed after the trainer receipted group x, before it saved that, sends the
    prompt again as group y (rollout/data_position.py): the prompt trains once. Decided when a
    group completes: an earlier partial group (its worker died mid-push) never blocks a later
    whole one. Trajectories without a key are never compared; the keys survive a checkpoint and
    a resume's discard of groups past it frees theirs."""
    buf = ReplayBuffer()
    assert buf.add(_keyed(traj, "half", 0, "0:1"))            # its worker died mid-push
    for k in range(2):
        buf.add(_keyed(traj, "x", k, "0:1"))
    assert buf.peek_order() == ["x"]
    assert buf.add(_keyed(traj, "y", 0, "0:1")) and not buf.add(_keyed(traj, "y", 1, "0:1"))
    assert not buf.add(_keyed(traj, "half", 1, "0:1"))        # completes after x: refused too
    assert buf.take_refused() == {"y": "duplicate: prompt 0:1 is group x's",
                                  "half": "duplicate: prompt 0:1 is group x's"}
    assert buf.counters["refused_duplicate"] == 2 and buf.n_partial == 0
    assert [g.prompt_key for g in buf.take(1, 0, 4).groups] == ["0:1"]
    fill(buf, traj, [("plain", 0, 2), ("plain-again", 0, 2)])  # no key: nothing to compare
    assert buf.peek_order() == ["plain", "plain-again"]

    restored = ReplayBuffer()
    restored.load_state_dict(buf.state_dict())
    for k in range(2):
        restored.add(_keyed(traj, "z", k, "0:1"))               # after the restart, still refused
        restored.add(_keyed(traj, "future", k, "0:2", v=5))
    assert list(restored.take_refused()) == ["z"] and "future" in restored.peek_order()
    assert restored.discard_future(version=2) == ["future"]
    for k in range(2):
        restored.add(_keyed(traj, "again", k, "0:2"))           # its prompt was never trained
    assert "again" in restored.peek_order()


def test_a_group_whose_samples_disagree_on_their_prompt_is_refused(traj):
    buf = ReplayBuffer()
    assert buf.add(_keyed(traj, "a", 0, "0:1"))
    assert not buf.add(_keyed(traj, "a", 1, "0:2"))
    assert "prompt_key" in buf.take_refused()["a"]


def test_group_ids_are_single_lines_and_older_checkpoints_still_load(traj):
    """The ids and prompt keys a buffer remembers are saved as strings of lines (a million of
    them load in a fraction of a second, not seconds), so an id with a line break is refused;
    checkpoints written before keep their lists and no prompt keys."""
    buf = ReplayBuffer()
    assert not buf.add(traj("a\nb", 0, group_size=1))
    assert not buf.add(_keyed(traj, "c", 0, "0:1\n", n=1))
    fill(buf, traj, [("d", 0, 1)])
    buf.take(1, 0, 4)
    state = buf.state_dict()
    assert isinstance(state["consumed"], str)
    assert buf.n_consumed == 2 and buf.counters["rejected_invalid"] == 2   # "a\nb" holds no slot
    old = {**state, "consumed": ["c", "d"]}
    del old["prompt_keys"], old["prompt_groups"]
    restored = ReplayBuffer()
    restored.load_state_dict(old)
    assert restored.n_consumed == 2 and not restored.add(traj("d", 0, group_size=1))
