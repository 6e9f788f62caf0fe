"""The admission rule and the group ledger (pure: no sockets, explicit time)."""
from __future__ import annotations

import random

import pytest

from tandem.services.controller.admission import AdmissionLedger, staleness_capacity

# (B, eta, version, accepted, running, max_concurrent) -> capacity
CAPACITY_TABLE = [
    ((4, 0, 0, 0, 0, 100), 4),        # eta = 0: exactly B per version
    ((4, 0, 0, 0, 4, 100), 0),        # ... and no more while they run
    ((4, 0, 0, 4, 0, 100), 0),        # ... or once they are accepted
    ((4, 0, 1, 4, 0, 100), 4),        # the next version opens the next B
    ((4, 0, 1, 3, 0, 100), 5),        # a rejected group of v0 left room (only 3 accepted)
    ((4, 2, 0, 0, 0, 100), 12),       # eta = 2: B * (eta + 1) ahead
    ((4, 2, 5, 20, 3, 100), 9),       # 4 * 8 - 23 = 9; concurrency not binding
    ((4, 2, 5, 20, 3, 5), 2),         # max_concurrent binds: 5 - 3
    ((4, 2, 5, 30, 3, 100), 0),       # over the bound (e.g. late accepts): never negative
    ((1, 0, 0, 0, 0, 100), 1),
    ((16, 4, 10, 160, 64, 64), 0),    # max_concurrent reached
]


@pytest.mark.parametrize("args,expected", CAPACITY_TABLE)
def test_capacity_table(args, expected):
    B, eta, v, acc, run, mc = args
    assert staleness_capacity(B, eta, v, acc, run, mc) == expected


def test_eta0_is_synchronous_exactly_b_per_version():
    B = 3
    ledger = AdmissionLedger(B, max_staleness=0, max_concurrent=1000)
    for version in range(5):
        tickets, _ = ledger.admit("w", 100, now=0.0)
        assert len(tickets) == B and {v for _, v in tickets} == {version}
        assert ledger.admit("w", 100, now=0.0)[0] == []          # nothing more until the step
        for gid, _ in tickets:
            ledger.finish("w", gid, "accepted", now=0.0)
        assert ledger.admit("w", 100, now=0.0)[0] == []          # accepted ones keep their slot
        ledger.set_version(version + 1)
    assert ledger.accepted == 5 * B


def test_rejected_and_failed_release_their_slot():
    ledger = AdmissionLedger(2, max_staleness=0, max_concurrent=1000)
    (a, _), (b, _) = ledger.admit("w", 10, 0.0)[0]
    ledger.finish("w", a, "rejected", 0.0)
    ledger.finish("w", b, "failed", 0.0)
    again = ledger.admit("w", 10, 0.0)[0]
    assert len(again) == 2 and ledger.rejected == 1 and ledger.failed == 1


def test_staleness_bound_holds_under_random_traffic():
    """Accepted groups admitted at version <= v never exceed B * (eta + v + 1)."""
    rng = random.Random(7)
    B, eta = 4, 2
    ledger = AdmissionLedger(B, eta, max_concurrent=9)
    accepted_at: dict[int, int] = {}
    running: list[tuple[str, int]] = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.4:
            tickets, _ = ledger.admit(f"w{rng.randrange(3)}", rng.randint(1, 5), 0.0)
            running += tickets
            assert len(ledger.running) <= 9
        elif r < 0.8 and running:
            gid, v = running.pop(rng.randrange(len(running)))
            status = rng.choice(["accepted", "accepted", "rejected", "failed"])
            ledger.finish(ledger.running[gid].worker_id, gid, status, 0.0)
            if status == "accepted":
                accepted_at[v] = accepted_at.get(v, 0) + 1
        elif ledger.accepted >= B * (ledger.version + 1):
            ledger.set_version(ledger.version + 1)   # the trainer consumed a batch
    assert ledger.version > 10
    for v in range(ledger.version + 1):
        assert sum(n for av, n in accepted_at.items() if av <= v) <= B * (eta + v + 1)


def test_max_concurrent_binds_and_batch_is_capped():
    ledger = AdmissionLedger(100, max_staleness=4, max_concurrent=5)
    assert len(ledger.admit("w", 3, 0.0)[0]) == 3
    assert len(ledger.admit("w", 10, 0.0)[0]) == 2
    assert ledger.admit("w", 10, 0.0)[0] == []


def test_reports_are_idempotent_and_checked():
    ledger = AdmissionLedger(2, 0, 10)
    (gid, _), _ = ledger.admit("w", 2, 0.0)[0]
    with pytest.raises(ValueError, match="belongs to worker"):
        ledger.finish("other", gid, "accepted", 0.0)
    with pytest.raises(ValueError, match="status must be one of"):
        ledger.finish("w", gid, "done", 0.0)
    assert ledger.finish("w", gid, "accepted", 0.0)[0] == "recorded"
    assert ledger.finish("w", gid, "accepted", 0.0) == ("duplicate", None)
    assert ledger.accepted == 1
    with pytest.raises(KeyError, match="unknown group"):
        ledger.finish("w", "9-999", "accepted", 0.0)
    with pytest.raises(ValueError, match="max_groups"):
        ledger.admit("w", 0, 0.0)


def test_versions_never_go_backwards_but_a_resumed_trainer_rebases():
    ledger = AdmissionLedger(4, 1, 100)
    ledger.set_version(3)
    with pytest.raises(ValueError, match="never go backwards"):
        ledger.set_version(2)
    ledger.accepted = 30        # groups lost with a crashed trainer were counted here
    ledger.rebase(version=2, groups_held=9)
    assert ledger.version == 2 and ledger.accepted == 9
    assert ledger.capacity() == 4 * (1 + 2 + 1) - 9


def test_lease_expiry_releases_a_silent_workers_groups():
    ledger = AdmissionLedger(4, 0, 100)
    dead = [g for g, _ in ledger.admit("dead", 2, now=0.0)[0]]
    alive = [g for g, _ in ledger.admit("alive", 2, now=0.0)[0]]
    assert ledger.capacity() == 0
    ledger.heartbeat("alive", alive, now=8.0)
    lost, event = ledger.expire(now=10.5, lease_s=10.0)
    assert lost == {"dead": dead} and event["why"] == "lease expired"
    assert ledger.failed == 2 and ledger.capacity() == 2 and set(ledger.running) == set(alive)
    # The dead worker comes back: its groups are revoked, and a late accept is still counted.
    revoked, _ = ledger.heartbeat("dead", dead, now=11.0)
    assert revoked == dead
    assert ledger.finish("dead", dead[0], "accepted", 11.0)[0] == "late_accept"
    assert (ledger.accepted, ledger.failed, ledger.late_accepts) == (1, 1, 1)


def test_heartbeat_reclaims_unknown_and_releases_orphans():
    ledger = AdmissionLedger(10, 0, 100)
    a, b = [g for g, _ in ledger.admit("w", 2, now=0.0)[0]]
    revoked, event = ledger.heartbeat("w", [a, "7-1"], now=1.0)   # 7-1: admitted by a lost state
    assert revoked == [] and "7-1" in ledger.running and event["op"] == "claim"
    assert b in ledger.running                                  # absent once: could be in flight
    ledger.heartbeat("w", [a, "7-1"], now=2.0)
    assert b not in ledger.running and ledger.failed == 1       # absent twice: orphaned, released
    c = ledger.admit("w", 1, now=2.5)[0][0][0]
    ledger.heartbeat("w", [a, "7-1"], now=3.0)
    assert c in ledger.running                                  # admitted after the previous heartbeat


def test_replaying_events_rebuilds_the_same_ledger():
    rng = random.Random(3)
    live = AdmissionLedger(3, 1, 7)
    events = []
    snapshot_at, snapshot = 150, None
    running = []
    for step in range(400):
        if step == snapshot_at:
            snapshot = live.state_dict()
            events = []
        r = rng.random()
        if r < 0.45:
            tickets, e = live.admit(f"w{rng.randrange(2)}", rng.randint(1, 4), float(step))
            running += [g for g, _ in tickets]
        elif r < 0.85 and running:
            gid = running.pop(rng.randrange(len(running)))
            if gid not in live.running:
                continue          # released by a lease expiry
            _, e = live.finish(live.running[gid].worker_id, gid, rng.choice(["accepted", "rejected"]), 0.0)
        elif r < 0.9:
            _, e = live.expire(float(step), lease_s=30.0)
        else:
            e = live.set_version(live.version + 1)
        if e is not None:
            events.append(e)
    restored = AdmissionLedger(3, 1, 7)
    restored.load_state_dict(snapshot, now=0.0)
    for e in events:
        restored.apply(e)
    assert restored.counters() | {"workers": 0} == live.counters() | {"workers": 0}
    assert set(restored.running) == set(live.running) and restored.next_seq == live.next_seq
    assert dict(restored.finished) == dict(live.finished)


def test_groups_the_trainer_drops_as_stale_give_their_slots_back():
    ledger = AdmissionLedger(2, max_staleness=0, max_concurrent=1000)
    granted, _ = ledger.admit("w", 5, 0.0)
    assert len(granted) == 2 and ledger.capacity() == 0
    for gid, _ in granted:
        ledger.finish("w", gid, "accepted", 0.0)
    assert ledger.capacity() == 0
    event = ledger.release_dropped([granted[0][0], granted[0][0], "never-seen"])
    assert event == {"op": "drop", "groups": [granted[0][0]], "pending": []}
    assert ledger.capacity() == 1 and ledger.counters()["dropped"] == 1
    assert ledger.release_dropped([granted[0][0]]) is None  # a second report changes nothing
    restored = AdmissionLedger(2, 0, 1000)
    restored.load_state_dict(ledger.state_dict(), 0.0)
    assert {k: v for k, v in restored.counters().items() if k != "workers"} == \
        {k: v for k, v in ledger.counters().items() if k != "workers"}


def _replayed(ledger: AdmissionLedger, events: list[dict]) -> AdmissionLedger:
    again = AdmissionLedger(ledger.B, ledger.eta, ledger.max_concurrent)
    for e in events:
        again.apply(e)
    return again


def test_a_drop_that_overtakes_the_workers_report_releases_the_slot_once():
    """The worker pushes a group's trajectories, then reports it accepted; the trainer can drop
    (or refuse) the group in between. Whichever arrives first, the slot is given back once."""
    ledger = AdmissionLedger(1, max_staleness=0, max_concurrent=1000)
    (gid, _), = ledger.admit("w", 1, 0.0)[0]
    events = [ledger.release_dropped([gid])]          # the trainer's drop arrives first
    assert events[0]["pending"] == [gid] and ledger.capacity() == 0   # still running
    outcome, done = ledger.finish("w", gid, "accepted", 0.0)          # then the worker's report
    events.append(done)
    assert outcome == "recorded"
    assert (ledger.accepted, ledger.dropped, ledger.capacity()) == (0, 1, 1)
    assert ledger.release_dropped([gid]) is None                       # a repeated drop: nothing
    assert ledger.finish("w", gid, "accepted", 0.0)[0] == "duplicate"  # a repeated report: nothing
    assert ledger.capacity() == 1
    # The journal replays to the same ledger.
    admit = {"op": "admit", "worker": "w", "version": 0, "epoch": 0, "first_seq": 0, "count": 1, "admitted_at": 0.0}
    assert _replayed(ledger, [admit] + events).counters() | {"workers": 1} == ledger.counters()


def test_a_drop_of_a_revoked_group_nets_out_its_late_accept():
    ledger = AdmissionLedger(1, max_staleness=0, max_concurrent=1000)
    (gid, _), = ledger.admit("w", 1, 0.0)[0]
    ledger.expire(100.0, lease_s=1.0)                 # revoked: counted failed, slot free
    assert ledger.capacity() == 1
    ledger.release_dropped([gid])                     # the trainer drops it
    assert ledger.finish("w", gid, "accepted", 100.0)[0] == "late_accept"
    assert (ledger.accepted, ledger.failed, ledger.dropped, ledger.capacity()) == (0, 0, 1, 1)


def test_a_drop_of_a_group_its_worker_failed_or_rejected_changes_nothing():
    ledger = AdmissionLedger(2, max_staleness=0, max_concurrent=1000)
    (a, _), (b, _) = ledger.admit("w", 2, 0.0)[0]
    ledger.finish("w", a, "failed", 0.0)
    ledger.finish("w", b, "rejected", 0.0)
    assert ledger.release_dropped([a, b]) is None and ledger.capacity() == 2


def test_a_restarted_controller_still_knows_every_group_it_remembered():
    """The snapshot keeps what memory keeps: a drop (or a pending drop) after a restart still
    finds its group."""
    ledger = AdmissionLedger(100, max_staleness=1000, max_concurrent=100_000)
    granted, _ = ledger.admit("w", 30_000, 0.0)
    assert len(granted) == 30_000
    for gid, _ in granted[:25_000]:
        ledger.finish("w", gid, "accepted", 0.0)
    ledger.release_dropped([granted[29_999][0]])      # running: pending
    restored = AdmissionLedger(100, 1000, 100_000)
    restored.load_state_dict(ledger.state_dict(), 0.0)
    assert dict(restored.finished) == dict(ledger.finished) and len(restored.finished) == 20_000
    oldest_remembered = next(iter(ledger.finished))
    assert restored.release_dropped([oldest_remembered])["groups"] == [oldest_remembered]
    assert restored.finish("w", granted[29_999][0], "accepted", 0.0)[0] == "recorded"
    assert restored.dropped == 2


def test_coalesced_versions_charge_each_group_to_the_version_served_when_admitted():
    """Coalesced weight versions (services/controller/pending_versions.py): the ledger's version
    jumps from what the servers held to the newest version applied, skipping the ones never
    served. Each group is charged to the version served when it was admitted (never a skipped
    one), the staleness bound holds for every version, and the journal replays the jumps."""
    rng = random.Random(11)
    B, eta = 4, 2
    ledger = AdmissionLedger(B, eta, max_concurrent=10)
    events, served, jumps = [], {0}, []
    accepted_at: dict[int, int] = {}
    running: list[tuple[str, int]] = []
    trainer_version = 0
    for step in range(4000):
        r = rng.random()
        e = None
        if r < 0.4:
            tickets, e = ledger.admit(f"w{rng.randrange(3)}", rng.randint(1, 5), float(step))
            assert all(v == ledger.version for _, v in tickets)
            running += tickets
        elif r < 0.8 and running:
            gid, v = running.pop(rng.randrange(len(running)))
            status = rng.choice(["accepted", "accepted", "accepted", "rejected"])
            _, e = ledger.finish(ledger.running[gid].worker_id, gid, status, 0.0)
            if status == "accepted":
                accepted_at[v] = accepted_at.get(v, 0) + 1
        elif r < 0.93:
            if ledger.accepted >= B * (trainer_version + 1):
                trainer_version += 1     # the trainer published a version; no server holds it yet
        elif trainer_version > ledger.version:
            # A sync ends: the servers hold the newest version published, whatever they skipped.
            jumps.append(trainer_version - ledger.version)
            e = ledger.set_version(trainer_version)
            served.add(trainer_version)
            assert ledger.capacity() == staleness_capacity(B, eta, trainer_version, ledger.accepted,
                                                           len(ledger.running), 10)
        if e is not None:
            events.append(e)
    assert trainer_version > 50 and sum(j > 1 for j in jumps) > 10
    assert {e["version"] for e in events if e["op"] == "admit"} <= served
    for v in range(ledger.version + 1):
        assert sum(n for av, n in accepted_at.items() if av <= v) <= B * (eta + v + 1)
    replayed = AdmissionLedger(B, eta, max_concurrent=10)
    for e in events:
        replayed.apply(e)
    assert replayed.counters() | {"workers": 0} == ledger.counters() | {"workers": 0}
    assert replayed.state_dict()["running"] == ledger.state_dict()["running"]


def test_groups_rejected_in_a_row_count_until_one_is_accepted_and_survive_a_restart():
    """What the trainer's cap on dynamic sampling reads (trainer/learning_signals.py): rejected
    groups since the last accepted one; a failure (a crashed generation) neither counts nor
    breaks the run of rejections. Journal replay and the snapshot both restore it."""
    ledger = AdmissionLedger(8, max_staleness=0, max_concurrent=1000)
    tickets = [gid for gid, _ in ledger.admit("w", 8, 0.0)[0]]
    events, seen = [], []
    for gid, status in zip(tickets, ["rejected", "rejected", "failed", "rejected", "accepted", "rejected"],
                           strict=False):
        events.append(ledger.finish("w", gid, status, 0.0)[1])
        seen.append(ledger.counters()["rejected_in_a_row"])
    assert seen == [1, 2, 2, 3, 0, 1]
    admit = {"op": "admit", "worker": "w", "version": 0, "epoch": 0, "first_seq": 0, "count": 8, "admitted_at": 0.0}
    assert _replayed(ledger, [admit] + events).rejected_in_a_row == 1
    restored = AdmissionLedger(8, 0, 1000)
    restored.load_state_dict(ledger.state_dict(), now=0.0)
    assert restored.rejected_in_a_row == 1
