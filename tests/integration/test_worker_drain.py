"""A rollout worker's drain at shutdown ends inside the launcher's grace, and names the groups a
dead trainer never receipted (issue 19's accounting).

Real sockets: a `TrajectorySink` plays a trainer that takes one group and dies before it
receipts the next; the worker side is `rollout.worker.drain` over a real `TrajectorySource`.
The in-flight episode is a task that never ends and, when cancelled, still takes its time to
report (a generation server left paused by the dead trainer's weight update, and a controller
report retried): what the fault suite's trainer kill can meet. Before the fix the drain waited
60 s for such a group and then 30 s for receipts, the launcher SIGKILLed the worker at 15 s,
and the groups delivered to the dead trainer were never logged as returned: `tandem audit`
called them lost.
"""
from __future__ import annotations

import asyncio
import time

from tandem.rollout.worker import DRAIN_S, drain
from tandem.services.protocol import STOP_GRACE_S, TrajectorySink, TrajectorySource


def test_the_drain_fits_the_grace_and_names_what_the_dead_trainer_never_receipted(keys, traj):
    trainer = TrajectorySink(keys)
    receipted: list[str] = []

    async def worker():
        src = TrajectorySource(keys, trainer.address)
        await src.send_group([traj("g1", 0, group_size=1)], lambda: receipted.append("g1"))
        sample = await asyncio.to_thread(trainer.recv, 10.0)
        trainer.confirm(sample)   # g1 is held by the trainer ...
        while not receipted:
            await asyncio.sleep(0.01)
        trainer.sock.close(0)     # ... which then dies: g2 goes nowhere
        await src.send_group([traj("g2", 0, group_size=1)], lambda: receipted.append("g2"))

        async def stuck_episode():
            try:
                await asyncio.Event().wait()
            finally:   # cancelled: its report to the controller is retried for a while
                await asyncio.sleep(600)

        running = {"g3": asyncio.ensure_future(stuck_episode())}
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        returned = await drain(running, src, budget_s=2.0)
        waited = time.monotonic() - t0
        cancelled = running["g3"].cancelling()   # asked to stop, still reporting
        src.close(linger_ms=0)
        return returned, waited, cancelled

    returned, waited, cancelled = asyncio.run(worker())
    assert returned == ["g2"] and receipted == ["g1"]
    assert waited < 2.0 + 5.0, waited      # the budget (and a loaded machine's slack), not ten minutes
    assert cancelled == 1
    assert DRAIN_S < STOP_GRACE_S          # a run's drain is inside the launcher's grace
