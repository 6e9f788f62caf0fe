"""Receipts on the trajectory channel: real sockets, the trainer's real intake thread and log.

A worker uses up a prompt only when the trainer has receipted the whole group, and a receipt
must mean the trajectory survives the trainer's death (it is in the log resume replays). The
workers here are `TrajectorySource`s on an asyncio loop in this process; the trainer side is
`trainer.intake.Intake` with its own thread, as in the trainer."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from tandem.services.protocol import TrajectorySink, TrajectorySource
from tandem.trainer.intake import Intake
from tandem.trainer.wal import TrajectoryLog, replay


def _intake(keys, tmp_path):
    return Intake(TrajectorySink(keys), TrajectoryLog(tmp_path / "t.wal", truncate=True))


def test_a_group_is_receipted_to_its_own_worker_once_every_sample_is_logged(keys, tmp_path, traj):
    intake = _intake(keys, tmp_path)
    receipted: list[str] = []

    async def workers():
        a, b = TrajectorySource(keys, intake.sink.address), TrajectorySource(keys, intake.sink.address)
        await a.send_group([traj("a1", 0), traj("a1", 1)], lambda: receipted.append("a1"))
        bad = traj("b1", 1, logprobs=np.array([np.nan] * 4))   # refused by the buffer, still decided
        await b.send_group([traj("b1", 0), bad], lambda: receipted.append("b1"))
        left = [await a.wait_receipts(timeout_s=10), await b.wait_receipts(timeout_s=10)]
        a.close(), b.close()
        return left

    assert asyncio.run(workers()) == [[], []]
    assert sorted(receipted) == ["a1", "b1"]
    logged = [(t.group_id, t.sample_idx) for t in replay(tmp_path / "t.wal")]
    assert sorted(logged) == [("a1", 0), ("a1", 1), ("b1", 0)]    # the invalid one is not kept
    assert len(intake.take(1.0)) == 4
    intake.close()


def test_nothing_is_receipted_while_paused_and_a_dead_trainer_receipts_nothing(keys, tmp_path, traj):
    intake = _intake(keys, tmp_path)
    receipted: list[str] = []

    async def worker():
        src = TrajectorySource(keys, intake.sink.address)
        with intake.paused():   # a checkpoint rotating the log
            await src.send_group([traj("g1", 0, group_size=1)], lambda: receipted.append("g1"))
            await asyncio.sleep(0.5)
            assert receipted == [] and src.unreceipted() == ["g1"]
        assert await src.wait_receipts(timeout_s=10) == [] and receipted == ["g1"]
        intake.close()          # the trainer is gone: what is sent now comes back unreceipted
        await src.send_group([traj("g2", 0, group_size=1)], lambda: receipted.append("g2"))
        # ... and the worker knows it from the closed connection, without waiting for a quiet
        # minute (a run's end, where the trainer exits first, would otherwise wait out quiet_s)
        t0 = time.monotonic()
        left = await src.wait_receipts(quiet_s=60.0, timeout_s=60.0)
        waited = time.monotonic() - t0
        src.close(linger_ms=0)
        return left, waited

    left, waited = asyncio.run(worker())
    assert left == ["g2"] and waited < 30, waited
    assert receipted == ["g1"]
