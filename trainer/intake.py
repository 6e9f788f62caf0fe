"""Trajectory intake on trainer rank 0: receive, make durable, receipt — also during a step.

A rollout worker counts a group delivered, and its prompt used, only when the trainer has
receipted every sample (services/protocol/trajectory_channel.py); a group without receipts is
generated again. A receipt must therefore mean "this survives a crash of the trainer": it is
sent after the trajectory is in the log that resume replays (wal.py). This thread does it as
trajectories arrive, also while a training step runs (minutes on a cluster), so receipts are
prompt, a stopping worker need not wait out a step, and the socket never backs up behind one.
The replay buffer stays with the main thread: `take()` hands over what arrived.

A checkpoint rotates the log inside `paused()`: the main thread moves everything handed over
into the buffer, snapshots it and starts the next log, so every receipted trajectory is in the
snapshot or in a log resume reads (resume replays every log from the checkpoint's on).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

from tandem.services.protocol import Trajectory, TrajectorySink
from tandem.trainer.buffer import validate
from tandem.trainer.trajectory_check import TrajectoryCheck
from tandem.trainer.wal import TrajectoryLog

log = logging.getLogger(__name__)
# Refused samples kept for the records between two takes (the count goes on past it).
MAX_REFUSALS_KEPT = 1000


class Intake:
    def __init__(self, sink: TrajectorySink, wal: TrajectoryLog, check: TrajectoryCheck | None = None):
        self.sink, self.wal, self.check = sink, wal, check
        # Samples refused before the buffer (trajectory_check.py): {group_id, sample_idx, sender,
        # reason} for the step record, taken by the main thread with take_refused().
        self._refused: list[dict] = []
        self.refused_total = self._refused_taken = 0
        # Not a SimpleQueue: on CPython 3.11 its get(timeout) can block forever when a signal
        # handler (SIGTERM) runs past the deadline during the wait; Queue recomputes what is left.
        self._arrived: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_by = float("inf")
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trajectory-intake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                body = self.sink.recv(timeout_s=0.05)
                if body is not None:
                    with self._lock:
                        self._accept(body)
                # Stopping: once the wire is quiet, or after a second of workers still pushing
                # (what they push later gets no receipt and is generated again).
                if self._stop.is_set() and (body is None or time.monotonic() > self._stop_by):
                    return
        except BaseException as e:  # the main thread raises it at its next take()
            self.error = e

    def _accept(self, body: Any) -> None:
        if isinstance(body, Trajectory):
            refusal = self.check.refusal(body, self.sink.sender_identity) if self.check is not None else None
            if refusal is not None:   # it reaches neither the log nor the group it names
                self.refused_total += 1
                if len(self._refused) < MAX_REFUSALS_KEPT:
                    self._refused.append({"group_id": body.group_id[:100], "sample_idx": body.sample_idx,
                                          "sender": self.sink.sender_identity, "reason": refusal})
                if self.refused_total <= 20 or self.refused_total % 1000 == 0:   # a flood must not fill the log
                    log.warning("refused sample %s/%s from %s: %s (%d so far)", body.group_id[:100],
                                body.sample_idx, self.sink.sender_identity, refusal, self.refused_total)
                self.sink.confirm(body)
                return
            # Invalid ones are not logged (the buffer refuses them and gives the slot back),
            # but receipted: the trainer has decided about them.
            if validate(body, self.check.vocab_size if self.check is not None else None) is None:
                self.wal.append(body)
            self.sink.confirm(body)
        self._arrived.put(body)

    def take_refused(self) -> tuple[list[dict], int]:
        """The samples refused before the buffer since the last call (the first MAX_REFUSALS_KEPT)
        and how many there were."""
        with self._lock:
            out, self._refused = self._refused, []
            count, self._refused_taken = self.refused_total - self._refused_taken, self.refused_total
        return out, count

    def take(self, timeout_s: float) -> list[Any]:
        """What arrived since the last take, waiting up to `timeout_s` for the first message."""
        if self.error is not None:
            raise RuntimeError(f"the trajectory intake thread failed: {self.error!r}") from self.error
        out = []
        try:
            out.append(self._arrived.get(timeout=timeout_s) if timeout_s > 0 else self._arrived.get_nowait())
            while True:
                out.append(self._arrived.get_nowait())
        except queue.Empty:
            pass
        return out

    @contextlib.contextmanager
    def paused(self):
        """Nothing is logged or handed over meanwhile (a checkpoint rotates the log)."""
        with self._lock:
            yield

    def close(self) -> None:
        """Take in what is still on the wire (until it is quiet), then stop. `take()` still
        hands over what arrived; receipts already queued leave with the socket's linger."""
        self._stop_by = time.monotonic() + 1.0
        self._stop.set()
        self._thread.join(timeout=10.0)
        self.sink.close()
