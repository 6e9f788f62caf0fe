"""The state store: snapshot + journal replay is exact, even across the crash windows."""
from __future__ import annotations

import pytest

from tandem.services.controller.admission import AdmissionLedger
from tandem.services.controller.state import StateStore


def _opened(tmp_path) -> tuple[StateStore, AdmissionLedger]:
    store = StateStore(tmp_path / "ctl")
    store.load()
    store.open()
    return store, AdmissionLedger(4, 1, 100)


def test_a_crash_between_snapshot_and_truncation_applies_nothing_twice(tmp_path):
    store, ledger = _opened(tmp_path)
    for _ in range(3):
        store.append(ledger.admit("w", 2, 0.0)[1])
    store.flush()
    # Snapshot written, then killed before the journal was emptied: simulate by re-appending.
    journal_before = store.journal_path.read_bytes()
    store.snapshot({"ledger": ledger.state_dict()})
    store.journal_path.write_bytes(journal_before)
    store.append(ledger.admit("w", 1, 0.0)[1])       # one more event after the snapshot
    store.close()

    again = StateStore(tmp_path / "ctl")
    snapshot, events = again.load()
    assert len(events) == 1 and events[0]["op"] == "admit" and events[0]["count"] == 1
    restored = AdmissionLedger(4, 1, 100)
    restored.load_state_dict(snapshot["ledger"], now=0.0)
    for e in events:
        restored.apply(e)
    assert set(restored.running) == set(ledger.running) and restored.admitted == 7


def test_events_reach_the_journal_at_a_flush_with_one_write_and_a_failed_one_keeps_them(tmp_path, monkeypatch):
    """The controller's request server flushes before it sends any reply: events wait in memory
    until then, all of them go in one write, and a write that fails (a full disk) loses none."""
    import os

    store, ledger = _opened(tmp_path)
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.append(ledger.admit("w", 1, 0.0)[1])
    assert store.journal_path.read_bytes() == b""
    writes, real_write = [], os.write

    def full_disk(fd, data):
        writes.append(len(data))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        store.flush()
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(len(data)) or real_write(fd, data))
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.flush()
    store.flush()                                   # nothing new: no write
    assert len(writes) == 2 and writes[0] < writes[1]
    assert [e["first_seq"] for e in StateStore(tmp_path / "ctl").load()[1]] == [0, 1, 2]
    store.append(ledger.admit("w", 1, 0.0)[1])      # covered by the snapshot: never written
    store.snapshot({"ledger": ledger.state_dict()})
    store.append(ledger.admit("w", 1, 0.0)[1])      # written when the store closes
    store.close()
    snapshot, events = StateStore(tmp_path / "ctl").load()
    assert snapshot["journal_seq"] == 4 and [e["first_seq"] for e in events] == [4]


def test_a_record_cut_by_the_crash_is_dropped_and_the_rest_kept(tmp_path):
    store, ledger = _opened(tmp_path)
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.close()
    data = store.journal_path.read_bytes()
    store.journal_path.write_bytes(data[:-3])        # the last write was cut short
    snapshot, events = StateStore(tmp_path / "ctl").load()
    assert snapshot is None and len(events) == 1


def test_a_journal_written_before_the_fields_had_names_still_resumes(tmp_path):
    """Journals of older runs used one-letter keys (w, v, e, s, n, t, g, st, held); a resume
    of such a run must rebuild the same ledger as the same events with named fields."""
    import msgpack

    old_events = [
        {"op": "admit", "w": "w1", "v": 0, "e": 0, "s": 0, "n": 3, "t": 1.0},
        {"op": "done", "g": "0-0", "st": "accepted"},
        {"op": "done", "g": "0-1", "st": "rejected"},
        {"op": "version", "v": 1},
        {"op": "batch", "events": [{"op": "claim", "w": "w2", "g": ["5-0"], "v": 1, "t": 2.0},
                                   {"op": "revoke", "g": ["0-2"], "why": "orphaned"}]},
        {"op": "late", "g": "0-2"},
        {"op": "drop", "g": ["0-0"]},
        {"op": "rebase", "v": 2, "held": 1},
    ]
    store = StateStore(tmp_path / "ctl")
    store.dir.mkdir(parents=True)
    store.journal_path.write_bytes(b"".join(msgpack.packb([i + 1, e], use_bin_type=True)
                                            for i, e in enumerate(old_events)))
    snapshot, events = store.load()
    assert snapshot is None and len(events) == len(old_events)
    resumed = AdmissionLedger(4, 1, 100)
    for e in events:
        resumed.apply(e)

    # The same history through today's API, which writes named fields.
    now = AdmissionLedger(4, 1, 100)
    assert now.admit("w1", 3, 1.0)[0] == [("0-0", 0), ("0-1", 0), ("0-2", 0)]
    now.finish("w1", "0-0", "accepted", 1.0)
    now.finish("w1", "0-1", "rejected", 1.0)
    now.set_version(1)
    now.apply({"op": "batch", "events": [
        {"op": "claim", "worker": "w2", "groups": ["5-0"], "version": 1, "admitted_at": 2.0},
        {"op": "revoke", "groups": ["0-2"], "why": "orphaned"}]})
    assert now.finish("w1", "0-2", "accepted", 3.0)[0] == "late_accept"
    now.release_dropped(["0-0"])
    now.rebase(2, 1)

    assert resumed.state_dict() == now.state_dict()
    assert resumed.counters() | {"workers": 0} == now.counters() | {"workers": 0}
    assert resumed.state_dict()["running"] == {"5-0": ["w2", 1]}
    assert resumed.accepted == 1 and resumed.failed == 0 and resumed.late_accepts == 1


def test_every_event_the_ledger_writes_uses_the_named_fields():
    from tandem.services.controller.admission import EVENT_FIELDS

    ledger = AdmissionLedger(2, 0, 10)
    written = [ledger.admit("w", 2, 0.0)[1], ledger.finish("w", "0-0", "accepted", 0.0)[1],
               ledger.set_version(1), ledger.rebase(1, 1), ledger.release_dropped(["0-0"]),
               ledger.heartbeat("w", ["9-9"], 1.0)[1], ledger.expire(100.0, 1.0)[1]]
    for event in written:
        assert set(event) - {"op"} == set(EVENT_FIELDS[event["op"]]), event
