"""Coalesced weight versions: of the announcements waiting for the sync lock, only the newest
is applied; the older ones are answered at once as superseded by it.

Why: with `controller.interruptible: false` an update waits on every server for its running
requests to finish (a drain of up to `rollout.max_new_tokens` tokens). A trainer that may run
ahead (`trainer/announcements.py`) announces N + 1, N + 2, ... while N drains. Applying them one
by one would drain the servers once per version; applying the newest skips the versions no
server ever served, and the servers jump straight to it.

Which announcements may be skipped: only those whose applier is `replayable` (the weights stay
on disk, so nothing is lost by never loading them). A broadcast announcement comes with tensors
the trainer sends while the servers receive them, so once sent it must be applied; it waits for
the lock as before and supersedes nothing.

Staleness accounting stays exact without any help from here: the ledger's version is set only
after a sync, to the version the servers then hold (`AdmissionLedger.set_version` accepts a
jump), so a group admitted before the jump carries the version that was served when it was
admitted, and the skipped versions are never anyone's admit version.
"""
from __future__ import annotations

import asyncio


class PendingVersions:
    """The waiting announcements of replayable weight messages, and the lock they wait for."""

    def __init__(self, lock: asyncio.Lock):
        self.lock = lock
        # (version, future): set to the newer version that superseded it.
        self._waiting: list[tuple[int, asyncio.Future]] = []
        self.superseded = 0   # announcements answered as superseded since the start

    async def acquire(self, version: int) -> int:
        """Wait for the sync lock as the announcement of `version`. Returns 0 holding the lock,
        or the newer version that superseded this one while it waited (not holding the lock).
        An announcement that arrives supersedes every older one still waiting."""
        loop = asyncio.get_running_loop()
        if not self.lock.locked() and not self._waiting:
            await self.lock.acquire()   # free: taken at once (no suspension), nothing to coalesce
            return 0
        still = []
        for older, fut in self._waiting:
            if older < version and not fut.done():
                fut.set_result(version)
                self.superseded += 1
            elif not fut.done():
                still.append((older, fut))
        mine = loop.create_future()
        self._waiting = [*still, (version, mine)]
        taking = asyncio.ensure_future(self.lock.acquire())
        try:
            await asyncio.wait({taking, mine}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
            if taking.done() and not taking.cancelled():
                self.lock.release()
            raise
        finally:
            self._waiting = [(v, f) for v, f in self._waiting if f is not mine]
        if taking.done() and not mine.done():
            return 0
        # Superseded (if the lock came at the same moment, hand it on).
        if not taking.done():
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
        if taking.done() and not taking.cancelled():
            self.lock.release()
        return mine.result()

    def newest_waiting(self) -> int | None:
        """The newest version waiting for the lock, if any (for the status reply)."""
        return max((v for v, f in self._waiting if not f.done()), default=None)
