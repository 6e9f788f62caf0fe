"""Checkpoint files and the trajectory log: complete-or-absent, pruned, crash-tolerant."""
from __future__ import annotations

import errno
import random

import numpy as np
import pytest
import torch

from tandem.trainer import checkpoint
from tandem.trainer.wal import TrajectoryLog, replay, wal_path


def test_save_load_latest_and_prune(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        checkpoint.save(root, step, 0, {"backend": {"w": torch.full((2,), float(step))}},
                        {"version": step}, keep=2)
    (root / ".step-4.tmp").mkdir()          # a save that died half-way is never picked up
    assert checkpoint.checkpoint_steps(root) == [2, 3]
    assert checkpoint.latest(root) == root / "step-3"
    rank_state, loop_state = checkpoint.load(checkpoint.latest(root), 0)
    assert loop_state == {"version": 3} and rank_state["backend"]["w"].tolist() == [3.0, 3.0]


def test_a_save_stopped_by_a_full_disk_leaves_nothing_and_a_dead_one_is_cleared_next_time(tmp_path):
    """The backend's sharded write fails as a full disk fails it (ENOSPC, raised by a stand-in
    writer after half its file): the half-written checkpoint is removed at once, the last whole one
    stays the latest; a temp directory a killed trainer left is removed by the next save."""
    root = tmp_path / "ckpt"
    checkpoint.save(root, 1, 0, {}, {"version": 1}, keep=2)

    def disk_full(d):
        d.mkdir()
        (d / "shard-0").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(root, 2, 0, {}, {"version": 2}, keep=2, write_sharded=disk_full)
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    (root / ".step-7.tmp").mkdir()              # a trainer SIGKILLed mid-save, in an earlier launch
    (root / ".step-7.tmp" / "rank-0.pt").write_bytes(b"half")
    checkpoint.save(root, 2, 0, {}, {"version": 2}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]


def test_rng_state_is_restored(tmp_path):
    checkpoint.save(tmp_path, 1, 0, {}, {}, keep=1)
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)
    checkpoint.load(tmp_path / "step-1", 0)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_missing_rank_file_names_the_likely_cause(tmp_path):
    checkpoint.save(tmp_path, 1, 0, {}, {}, keep=1)
    try:
        checkpoint.load(tmp_path / "step-1", 1)
    except FileNotFoundError as e:
        assert "different number of trainer ranks" in str(e)
    else:
        raise AssertionError("expected FileNotFoundError")


def test_trajectory_log_replays_in_order_and_skips_a_torn_tail(tmp_path, traj):
    path = wal_path(tmp_path, 3)
    log = TrajectoryLog(path, truncate=True)
    sent = [traj(f"g{i}", 0, group_size=1, seed=i) for i in range(5)]
    for t in sent:
        log.append(t)
    log.close()
    with open(path, "ab") as f:          # a record cut short by SIGKILL mid-write
        f.write(b"\x40\x00\x00\x00partial")
    got = list(replay(path))
    assert [t.group_id for t in got] == [f"g{i}" for i in range(5)]
    assert np.array_equal(got[2].output_ids, sent[2].output_ids)
    assert list(replay(tmp_path / "missing.wal")) == []
    TrajectoryLog(path, truncate=True).close()
    assert list(replay(path)) == []


def test_checkpoints_load_without_unpickling_code(tmp_path):
    """Loaded with weights_only=True: a file that would run code on load is refused, and the RNG
    states (NumPy's included) still come back exactly."""
    import pickle

    import pytest

    np.random.seed(3)
    random.seed(3)
    state = checkpoint.rng_state()
    expected = (np.random.rand(), random.random())
    np.random.seed(0)
    random.seed(0)
    torch.save(state, tmp_path / "rng.pt")
    checkpoint.set_rng_state(checkpoint._load_file(tmp_path / "rng.pt"))
    assert (np.random.rand(), random.random()) == expected

    class Evil:
        def __reduce__(self):
            return (print, ("ran code on load",))

    with open(tmp_path / "evil.pt", "wb") as f:
        torch.save({"x": Evil()}, f, pickle_module=pickle)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint._load_file(tmp_path / "evil.pt")
