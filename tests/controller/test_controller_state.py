"""The state store: snapshot + journal replay is exact, even across the crash windows."""
from __future__ import annotations

from services.controller.admission import AdmissionLedger
from services.controller.state import StateStore


def test_a_crash_between_snapshot_and_truncation_applies_nothing_twice(tmp_path):
    store = StateStore(tmp_path / "ctl")
    store.load()
    store.open()
    ledger = AdmissionLedger(4, 1, 100)
    for _ in range(3):
        store.append(ledger.admit("w", 2, 0.0)[1])
    # Snapshot written, then killed before the journal was emptied: simulate by re-appending.
    journal_before = store.journal_path.read_bytes()
    store.snapshot({"ledger": ledger.state_dict()})
    store.journal_path.write_bytes(journal_before)
    store.append(ledger.admit("w", 1, 0.0)[1])       # one more event after the snapshot
    store.close()

    again = StateStore(tmp_path / "ctl")
    snapshot, events = again.load()
    assert len(events) == 1 and events[0]["op"] == "admit" and events[0]["n"] == 1
    restored = AdmissionLedger(4, 1, 100)
    restored.load_state_dict(snapshot["ledger"], now=0.0)
    for e in events:
        restored.apply(e)
    assert set(restored.running) == set(ledger.running) and restored.admitted == 7


def test_a_record_cut_by_the_crash_is_dropped_and_the_rest_kept(tmp_path):
    store = StateStore(tmp_path / "ctl")
    store.load()
    store.open()
    ledger = AdmissionLedger(4, 1, 100)
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.append(ledger.admit("w", 1, 0.0)[1])
    store.close()
    data = store.journal_path.read_bytes()
    store.journal_path.write_bytes(data[:-3])        # the last write was cut short
    snapshot, events = StateStore(tmp_path / "ctl").load()
    assert snapshot is None and len(events) == 1
