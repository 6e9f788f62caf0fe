"""Feeding a trainer process from a test, as a rollout worker does: trajectories over the
trainer's announced PUSH/PULL channel."""
from __future__ import annotations

import asyncio
import time

from tandem.services.protocol import ExpDir, TrajectorySource, load_keys, read_service


def send(exp: ExpDir, trajectories, old_pid=None):
    """Push trajectories to the trainer announced in <exp>/services/trainer.json."""
    deadline = time.monotonic() + 60
    while True:
        info = read_service(exp, "trainer", timeout_s=60)
        if info["pid"] != old_pid:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)

    async def go():
        src = TrajectorySource(load_keys(exp.keys), info["trajectory_address"])
        for t in trajectories:
            await src.send(t)
        src.close()
    asyncio.run(go())
