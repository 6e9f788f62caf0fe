"""Which weight announcements the trainer waits for before publishing the next version
(trainer/announcements.py), and how the controller link reads a superseded ack. No sockets:
announcements are stand-in calls the test answers."""
from __future__ import annotations

from tandem.services.protocol import WeightsAck, WeightsOnDisk
from tandem.trainer.announcements import Announcements, coalesces_versions, oldest_allowed


class Call:
    """A BackgroundCall stand-in: unanswered until `answer`."""

    def __init__(self):
        self.out = None

    def answer(self, out: dict) -> None:
        self.out = out

    def result(self, timeout_s=None) -> dict:
        if self.out is None:
            raise TimeoutError("waiting")
        return self.out


def waiter(log: list[int], calls: dict[int, Call]):
    """The trainer's wait: records which version it blocked on, then answers it."""
    def wait(call) -> dict:
        version = next(v for v, c in calls.items() if c is call)
        log.append(version)
        call.answer({"ack_ok": True})
        return call.out
    return wait


def test_coalescing_waits_only_for_the_versions_a_publish_would_prune():
    calls = {v: Call() for v in (1, 2, 3)}
    waited: list[int] = []
    ann = Announcements(coalesce=True, keep_weights=3, wait=waiter(waited, calls))
    for v in (1, 2):
        ann.make_room(v)
        ann.add(v, calls[v])
    ann.make_room(3)                   # keeps v1..v3 on disk: nothing to wait for
    assert waited == [] and oldest_allowed(3, 3) == 1
    ann.add(3, calls[3])
    calls[2].answer({"ack_ok": True, "superseded_by": 3})   # answered meanwhile (superseded)
    ann.make_room(4)                   # would prune v1: wait for it; v2 is already answered
    assert waited == [1] and [v for v, _ in ann.pending] == [3]
    assert ann.superseded_since_last() == {"versions_superseded": 1}
    assert ann.superseded_since_last() == {}
    ann.wait_all()
    assert waited == [1, 3] and ann.pending == []


def test_without_coalescing_every_announcement_is_answered_before_the_next_publish():
    calls = {1: Call()}
    waited: list[int] = []
    ann = Announcements(coalesce=False, keep_weights=5, wait=waiter(waited, calls))
    ann.add(1, calls[1])
    ann.make_room(2)
    assert waited == [1] and ann.pending == []
    # keep_weights 1 leaves nothing to overlap either: the version being loaded would be pruned.
    ann = Announcements(coalesce=True, keep_weights=1, wait=waiter(waited, calls := {1: Call()}))
    ann.add(1, calls[1])
    ann.make_room(2)
    assert waited == [1, 1]


def test_coalescing_needs_non_interruptible_generation_disk_weights_and_no_wait_for_each_ack():
    assert coalesces_versions(interruptible=False, weight_sync="disk", wait_for_ack=False)
    assert not coalesces_versions(interruptible=True, weight_sync="disk", wait_for_ack=False)
    assert not coalesces_versions(interruptible=False, weight_sync="broadcast", wait_for_ack=False)
    assert not coalesces_versions(interruptible=False, weight_sync="disk", wait_for_ack=True)


def test_the_link_reads_a_superseded_ack_as_answered_not_failed():
    from tandem.trainer.controller_link import ControllerLink

    link = ControllerLink.__new__(ControllerLink)
    link.timeout_s = 1.0
    link.request = lambda body, what, timeout_s=None: WeightsAck(version=body.version, ok=True, failed_servers=[],
                                                                 timings={}, superseded_by=body.version + 1)
    out = link.weights_ready(WeightsOnDisk(version=4, path="/w/v4"))
    assert out["ack_ok"] is True and out["superseded_by"] == 5 and "failed_servers" not in out
