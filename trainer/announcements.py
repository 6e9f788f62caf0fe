"""The trainer's weight announcements still waiting for the controller's answer, and when it may
announce the next version before the previous one was answered (coalesced versions).

With `controller.interruptible: false` a server drains its running requests (up to
`rollout.max_new_tokens` each) before it loads a version. If the trainer waited for version N's
ack before publishing N + 1, every drain would hold training back, which is not what a user of
non-interruptible generation pays on other systems. So, when versions may be coalesced
(`coalesces_versions`), the trainer publishes and announces N + 1, N + 2, ... while N is still
being applied; the controller keeps only the newest waiting announcement, answers the older
ones `superseded_by` the newer one, and the servers jump straight to it
(`services/controller/pending_versions.py`).

What bounds the run-ahead is the disk: publishing v prunes everything but the newest
`trainer.keep_weights` versions (`trainer/weights/disk.py`), so before publishing v every
announcement of a version v - keep_weights or older must have been answered (applied or
superseded) — the controller may be loading it. With `keep_weights: 1` nothing overlaps. The
version the controller applied last is not kept on purpose: keeping it too would hold the
trainer to keep_weights - 1 versions past the one the servers hold, which a long drain makes
the bottleneck (the simulator puts that at most of the coalescing gain at the paper's shape). A
lagging server being caught up to it meanwhile (a replay of the current disk version) may then
find it gone; it stays out of rotation and is caught up to the next version once the sync in
progress ends, as any failed catch-up is.

Only disk weights are coalesced: a broadcast announcement comes with tensors the servers must
receive while the trainer sends them, so it cannot be skipped once sent, and the trainer sends
one at a time. The staleness bound itself needs nothing here: admission follows the
controller's version, the one the servers actually hold.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def coalesces_versions(interruptible: bool, weight_sync: str, wait_for_ack: bool) -> bool:
    """Whether the trainer may announce a version while an earlier one is still being applied:
    non-interruptible generation (a drain holds every update), disk weights (a version on disk
    can be skipped; a broadcast cannot), and a trainer that does not wait for each ack anyway."""
    return not interruptible and weight_sync == "disk" and not wait_for_ack


def oldest_allowed(version: int, keep_weights: int) -> int:
    """The oldest version that may still be unanswered when `version` is published: publishing
    it keeps only the newest `keep_weights` versions on disk."""
    return version - keep_weights + 1


class Announcements:
    """Announcements sent and not yet answered, oldest first: (version, call). `call` is a
    `BackgroundCall`-like object (`result(timeout_s)` returns the link's outcome dict and raises
    TimeoutError while it is still waiting). `wait` resolves one (`Trainer._await`: it gives up
    on shutdown)."""

    def __init__(self, coalesce: bool, keep_weights: int, wait: Callable[[object], dict]):
        self.coalesce = coalesce
        self.keep_weights = keep_weights
        self._wait = wait
        # A fresh `ControllerLink` (rank 0 sets it): each announcement waits on its own socket,
        # so several can wait at once and the trainer keeps its own link for other requests.
        self.new_link: Callable[[], object] | None = None
        self.pending: list[tuple[int, object]] = []
        # Outcomes of answered announcements not yet collected (superseded ones included).
        self.answered: list[dict] = []

    def send(self, version: int, message, sender=None):
        """Announce `message` in the background (with the transfer `sender`, e.g. a broadcast,
        running meanwhile); returns the call, whose result is the link's outcome dict."""
        from tandem.trainer.weights import BackgroundCall  # the simulator imports this module: no torch

        def announce() -> dict:
            link = self.new_link()
            try:
                return link.weights_ready(message, sender)
            finally:
                link.close()
        return BackgroundCall(announce, f"weights v{version} announcement")

    def add(self, version: int, call) -> None:
        """Leave `call` waiting (trainer.wait_for_ack: false); `make_room` collects it."""
        self.pending.append((version, call))

    def make_room(self, version: int) -> None:
        """Before publishing `version`: wait for every announcement that must be answered first —
        all of them without coalescing, else those whose weights the publish would prune."""
        self._collect_finished()
        limit = oldest_allowed(version, self.keep_weights) if self.coalesce else version + 1
        while self.pending and self.pending[0][0] < limit:
            self._resolve(self.pending.pop(0))

    def wait_all(self) -> None:
        while self.pending:
            self._resolve(self.pending.pop(0))

    def superseded_since_last(self) -> dict:
        """For the step's record: how many announcements answered since the last call were
        superseded (never applied: the servers went straight to a newer version)."""
        n = sum(1 for a in self.answered if a.get("superseded_by"))
        self.answered = []
        return {"versions_superseded": n} if n else {}

    def _collect_finished(self) -> None:
        """Move the announcements answered meanwhile (e.g. superseded ones) out of the way."""
        still = []
        for version, call in self.pending:
            try:
                out = call.result(timeout_s=0)
            except TimeoutError:
                still.append((version, call))
                continue
            except Exception as e:   # the link logs its own failures; never lose the loop to one
                log.error("weights v%d: announcement failed: %s", version, e)
                continue
            self._note(version, out)
        self.pending = still

    def _resolve(self, item: tuple[int, object]) -> None:
        version, call = item
        try:
            self._note(version, self._wait(call))
        except Exception as e:
            log.error("weights v%d: announcement failed: %s", version, e)

    def _note(self, version: int, out: dict) -> None:
        self.answered.append({"version": version, **(out or {})})
