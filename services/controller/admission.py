"""The staleness-bounded admission rule and the ledger of prompt groups (pure, no I/O).

The rule is AReaL's: with B groups per training step, eta the allowed staleness and V the
latest trained version,

    capacity = min(max_concurrent - running, B * (eta + V + 1) - (accepted + running))

so a group admitted at version V is consumed by step V + eta + 1 at the latest (the trainer
takes the oldest first), and eta = 0 admits exactly B groups per version: synchronous RL.
Rejected and failed groups give their slot back; accepted ones keep it until the trainer
trains them, or gives it back when it drops them (over-stale) or refuses them (invalid) — once,
whichever of the trainer's drop and the worker's "accepted" report arrives first.

Every change of state is an *event* (a small dict with named fields, see `EVENT_FIELDS`)
applied by `apply()`. The controller journals each event before it answers, and a restarted
controller replays the journal on top of the last snapshot, so the ledger after a crash is the
ledger before it, exactly. Journals written before the fields had names (`w, v, e, s, n, t, g,
st, held`) are read through `named_fields()`, so an old run still resumes.
Time is passed in by the caller (monotonic seconds), which keeps this module testable.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

STATUSES = ("accepted", "rejected", "failed")
# Finished groups remembered (in memory and in every snapshot, so a restart forgets nothing)
# so a report repeated after a reconnect, or a drop that comes after the report, is recognised.
# The trainer drops only groups it holds, at most a few steps' worth: B * (eta + 1) plus what
# is in flight, far fewer than this.
FINISHED_MEMORY = 20_000


def staleness_capacity(groups_per_step: int, max_staleness: int, version: int, accepted: int,
                       running: int, max_concurrent: int) -> int:
    """How many more groups may start now (never negative)."""
    by_staleness = groups_per_step * (max_staleness + version + 1) - (accepted + running)
    return max(0, min(max_concurrent - running, by_staleness))


# Each event's fields ("op" aside). admit: tickets `epoch-first_seq` .. `epoch-(first_seq+count-1)`
# to `worker` at `version`, at monotonic time `admitted_at`; claim: groups a heartbeat listed
# that this ledger never saw; revoke: groups released by the controller (`why`); drop: accepted
# groups the trainer discarded, and `pending`: groups it discarded before their worker reported
# them accepted (netted when that report comes); rebase: the trainer resumed at `version`
# holding `groups_held`.
EVENT_FIELDS = {
    "admit": ("worker", "version", "epoch", "first_seq", "count", "admitted_at"),
    "done": ("group", "status"),
    "late": ("group",),
    "claim": ("worker", "groups", "version", "admitted_at"),
    "revoke": ("groups", "why"),
    "version": ("version",),
    "drop": ("groups", "pending"),
    "rebase": ("version", "groups_held"),
    "batch": ("events",),
}
# The one-letter keys journals used before the fields were named, per op.
LEGACY_KEYS = {
    "admit": {"w": "worker", "v": "version", "e": "epoch", "s": "first_seq", "n": "count", "t": "admitted_at"},
    "done": {"g": "group", "st": "status"},
    "late": {"g": "group"},
    "claim": {"w": "worker", "g": "groups", "v": "version", "t": "admitted_at"},
    "revoke": {"g": "groups"},
    "version": {"v": "version"},
    "drop": {"g": "groups"},
    "rebase": {"v": "version", "held": "groups_held"},
}


def named_fields(event: dict) -> dict:
    """`event` with its current field names (an event from an old journal is renamed). A batch's
    inner events are renamed when `apply` recurses into them."""
    renames = LEGACY_KEYS.get(event.get("op"), {})
    if renames.keys().isdisjoint(event):
        return event
    return {renames.get(key, key): value for key, value in event.items()}


@dataclass(slots=True)
class RunningGroup:
    worker_id: str
    admit_version: int
    admitted_at: float


@dataclass
class Lease:
    """A worker's liveness: any request renews it; heartbeats also reconcile its groups."""
    last_seen: float
    # Arrival time of the worker's previous heartbeat (None before its first).
    last_heartbeat: float | None = None
    # Groups absent from the worker's latest heartbeat (released if absent twice).
    absent: set[str] = field(default_factory=set)


class AdmissionLedger:
    def __init__(self, groups_per_step: int, max_staleness: int, max_concurrent: int, epoch: int = 0):
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.B, self.eta, self.max_concurrent = groups_per_step, max_staleness, max_concurrent
        self.epoch = epoch
        self.version = 0
        self.accepted = self.rejected = self.failed = 0
        # Groups their workflow rejected since the last one accepted (dynamic sampling's all-equal
        # groups in a row): the trainer warns on it and caps it (trainer/learning_signals.py).
        self.rejected_in_a_row = 0
        # Accepted groups the trainer later dropped as over-stale (their slots were released).
        self.dropped = 0
        self.admitted = 0          # tickets ever issued
        self.late_accepts = 0      # revoked groups whose worker reported them accepted afterwards
        self.next_seq = 0
        self.running: dict[str, RunningGroup] = {}
        # group_id -> (status, revoked): revoked = released by the controller, not by its worker.
        self.finished: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        # Groups the trainer dropped before their worker's report: an "accepted" report for one
        # of them takes no slot (it is counted dropped at once).
        self.drop_pending: OrderedDict[str, None] = OrderedDict()
        self.leases: dict[str, Lease] = {}
        self.events_applied = 0

    # ---- the rule -----------------------------------------------------------------------
    def capacity(self) -> int:
        return staleness_capacity(self.B, self.eta, self.version, self.accepted, len(self.running),
                                  self.max_concurrent)

    # ---- requests (each returns its result and the event it applied, or None) -------------
    def admit(self, worker_id: str, max_groups: int, now: float) -> tuple[list[tuple[str, int]], dict | None]:
        """Grant up to `max_groups` tickets: [(group_id, admit_version)]."""
        if max_groups < 1:
            raise ValueError(f"admit: max_groups must be >= 1, got {max_groups}")
        self.touch(worker_id, now)
        n = min(max_groups, self.capacity())
        if n == 0:
            return [], None
        event = {"op": "admit", "worker": worker_id, "version": self.version, "epoch": self.epoch,
                 "first_seq": self.next_seq, "count": n, "admitted_at": now}
        self.apply(event)
        return [(self._gid(event["epoch"], event["first_seq"] + i), event["version"]) for i in range(n)], event

    def finish(self, worker_id: str, group_id: str, status: str, now: float) -> tuple[str, dict | None]:
        """A worker's report. Returns "recorded", "duplicate" or "late_accept"."""
        if status not in STATUSES:
            raise ValueError(f"group_done: status must be one of {list(STATUSES)}, got {status!r}")
        self.touch(worker_id, now)
        group = self.running.get(group_id)
        if group is not None:
            if group.worker_id != worker_id:
                raise ValueError(f"group_done: group {group_id} belongs to worker {group.worker_id!r}, "
                                 f"not {worker_id!r}")
            event = {"op": "done", "group": group_id, "status": status}
            self.apply(event)
            return "recorded", event
        previous = self.finished.get(group_id)
        if previous is None:
            raise KeyError(f"group_done: unknown group {group_id!r} (never admitted, or finished too long ago)")
        old_status, revoked = previous
        if revoked and status == "accepted" and old_status == "failed":
            # Its trajectories reached the trainer after all: count them, or the bound leaks.
            event = {"op": "late", "group": group_id}
            self.apply(event)
            return "late_accept", event
        return "duplicate", None

    def heartbeat(self, worker_id: str, running: list[str], now: float) -> tuple[list[str], dict | None]:
        """Renew the lease and reconcile; returns the groups the worker must stop (revoked)."""
        lease = self.touch(worker_id, now)
        listed = set(running)
        revoked, claims = [], []
        for gid in running:
            group = self.running.get(gid)
            if group is None:
                previous = self.finished.get(gid)
                if previous is None:
                    claims.append(gid)         # admitted by a state this controller never saw
                elif previous[1]:
                    revoked.append(gid)        # released by the controller (lease expired, orphaned)
                # else: its own report crossed this heartbeat on the wire; nothing to do
            elif group.worker_id != worker_id:
                revoked.append(gid)
        # A group missing from two heartbeats in a row, admitted before the earlier one arrived,
        # is one the worker no longer runs and never reported: release it.
        mine = {gid for gid, g in self.running.items() if g.worker_id == worker_id and gid not in listed}
        orphans = []
        if lease.last_heartbeat is not None:
            orphans = sorted(gid for gid in mine & lease.absent
                             if self.running[gid].admitted_at < lease.last_heartbeat)
        lease.absent = mine - set(orphans)
        lease.last_heartbeat = now
        events = []
        if claims:
            events.append({"op": "claim", "worker": worker_id, "groups": claims, "version": self.version,
                           "admitted_at": now})
        if orphans:
            events.append({"op": "revoke", "groups": orphans, "why": "orphaned"})
        for e in events:
            self.apply(e)
        if not events:
            return revoked, None
        return revoked, events[0] if len(events) == 1 else {"op": "batch", "events": events}

    def expire(self, now: float, lease_s: float) -> tuple[dict[str, list[str]], dict | None]:
        """Fail the groups of workers silent for longer than `lease_s`; {worker: [group_id]}."""
        dead = [w for w, lease in self.leases.items() if now - lease.last_seen > lease_s]
        if not dead:
            return {}, None
        lost: dict[str, list[str]] = {w: [] for w in dead}
        for gid, g in self.running.items():
            if g.worker_id in lost:
                lost[g.worker_id].append(gid)
        for w in dead:
            del self.leases[w]
        gids = [gid for gs in lost.values() for gid in gs]
        if not gids:
            return lost, None
        event = {"op": "revoke", "groups": gids, "why": "lease expired"}
        self.apply(event)
        return lost, event

    def set_version(self, version: int) -> dict | None:
        if version < self.version:
            raise ValueError(f"version {version} is behind the current version {self.version}; "
                             f"versions never go backwards")
        if version == self.version:
            return None
        event = {"op": "version", "version": version}
        self.apply(event)
        return event

    def rebase(self, version: int, groups_held: int) -> dict:
        """The trainer resumed from a checkpoint: it, not this ledger, knows what it holds."""
        if version < 0 or groups_held < 0:
            raise ValueError(f"trainer_resumed: version and groups_held must be >= 0, "
                             f"got {version} and {groups_held}")
        event = {"op": "rebase", "version": version, "groups_held": groups_held}
        self.apply(event)
        return event

    def release_dropped(self, group_ids: list[str]) -> dict | None:
        """Groups the trainer discarded (over-stale, or refused as invalid) give their slots back,
        exactly once. The trainer may drop a group before its worker's "accepted" report arrives
        (the worker pushes the trajectories, then reports): such a group is remembered, and the
        report, when it comes, takes no slot."""
        now, later = [], []
        for gid in dict.fromkeys(group_ids):
            status, revoked = self.finished.get(gid, ("", False))
            if status == "accepted":
                now.append(gid)
            elif gid in self.drop_pending:
                continue
            elif gid in self.running or (status == "failed" and revoked):
                later.append(gid)   # its accepted report (or a late one) is still to come
            # dropped already, rejected or failed by its worker (slot given back), or unknown: nothing
        if not now and not later:
            return None
        event = {"op": "drop", "groups": now, "pending": later}
        self.apply(event)
        return event

    def touch(self, worker_id: str, now: float) -> Lease:
        lease = self.leases.get(worker_id)
        if lease is None:
            lease = self.leases[worker_id] = Lease(now)
        else:
            lease.last_seen = now
        return lease

    # ---- the one mutation path ----------------------------------------------------------
    def apply(self, event: dict) -> None:
        """Apply one event; events of old journals (one-letter keys) are renamed first."""
        event = named_fields(event)
        op = event["op"]
        if op == "admit":
            for i in range(event["count"]):
                gid = self._gid(event["epoch"], event["first_seq"] + i)
                self.running[gid] = RunningGroup(event["worker"], event["version"], event["admitted_at"])
            self.next_seq = max(self.next_seq, event["first_seq"] + event["count"])
            self.epoch = max(self.epoch, event["epoch"])
            self.admitted += event["count"]
        elif op == "done":
            gid, status = event["group"], event["status"]
            self.running.pop(gid)
            if status != "failed":   # a failure says nothing of the groups' rewards
                self.rejected_in_a_row = self.rejected_in_a_row + 1 if status == "rejected" else 0
            if self._dropped_first(gid) and status == "accepted":
                self.dropped += 1                  # the trainer already dropped it: no slot taken
                self._remember(gid, "dropped", False)
            else:
                self._count(status, +1)
                self._remember(gid, status, False)
        elif op == "late":
            gid = event["group"]
            self.failed -= 1
            self.rejected_in_a_row = 0
            self.late_accepts += 1
            if self._dropped_first(gid):
                self.dropped += 1
                self._remember(gid, "dropped", False)
            else:
                self.accepted += 1
                self._remember(gid, "accepted", False)
        elif op == "revoke":
            for gid in event["groups"]:
                if self.running.pop(gid, None) is not None:
                    self.failed += 1
                    self._remember(gid, "failed", True)
        elif op == "claim":
            for gid in event["groups"]:
                self.running[gid] = RunningGroup(event["worker"], event["version"], event["admitted_at"])
        elif op == "version":
            self.version = event["version"]
        elif op == "drop":
            for gid in event["groups"]:
                self.accepted -= 1
                self.dropped += 1
                self._remember(gid, "dropped", False)
            for gid in event.get("pending", ()):
                self.drop_pending[gid] = None
                while len(self.drop_pending) > FINISHED_MEMORY:
                    self.drop_pending.popitem(last=False)
        elif op == "rebase":
            self.version = event["version"]
            self.accepted = event["groups_held"]
        elif op == "batch":
            for e in event["events"]:
                self.apply(e)
            return
        else:
            raise ValueError(f"unknown ledger event {op!r}")
        self.events_applied += 1

    def _dropped_first(self, gid: str) -> bool:
        """Whether the trainer dropped `gid` before this report (forgotten once asked)."""
        if gid in self.drop_pending:
            del self.drop_pending[gid]
            return True
        return False

    def _count(self, status: str, delta: int) -> None:
        setattr(self, status, getattr(self, status) + delta)

    def _remember(self, gid: str, status: str, revoked: bool) -> None:
        self.finished[gid] = (status, revoked)
        self.finished.move_to_end(gid)
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)

    @staticmethod
    def _gid(epoch: int, seq: int) -> str:
        return f"{epoch}-{seq}"

    # ---- persistence --------------------------------------------------------------------
    def counters(self) -> dict:
        return {"version": self.version, "capacity": self.capacity(), "running": len(self.running),
                "accepted": self.accepted, "rejected": self.rejected, "failed": self.failed,
                "admitted": self.admitted, "late_accepts": self.late_accepts, "dropped": self.dropped,
                "rejected_in_a_row": self.rejected_in_a_row, "workers": len(self.leases)}

    def state_dict(self) -> dict:
        finished = self.finished.items()
        return {"epoch": self.epoch, "version": self.version, "accepted": self.accepted,
                "rejected": self.rejected, "failed": self.failed, "admitted": self.admitted,
                "late_accepts": self.late_accepts, "next_seq": self.next_seq, "dropped": self.dropped,
                "rejected_in_a_row": self.rejected_in_a_row,
                "running": {gid: [g.worker_id, g.admit_version] for gid, g in self.running.items()},
                "finished": [[gid, st, rv] for gid, (st, rv) in finished],
                "drop_pending": list(self.drop_pending)}

    def load_state_dict(self, state: dict, now: float) -> None:
        """Restore; every worker gets a fresh lease from `now` (clocks do not survive a restart)."""
        for key in ("epoch", "version", "accepted", "rejected", "failed", "admitted", "late_accepts", "next_seq"):
            setattr(self, key, int(state[key]))
        self.dropped = int(state.get("dropped", 0))
        self.rejected_in_a_row = int(state.get("rejected_in_a_row", 0))
        self.running = {gid: RunningGroup(w, int(v), now) for gid, (w, v) in state["running"].items()}
        self.finished = OrderedDict((gid, (st, bool(rv))) for gid, st, rv in state["finished"])
        self.drop_pending = OrderedDict.fromkeys(state.get("drop_pending", ()))
        self.leases = {}
        for g in self.running.values():
            self.touch(g.worker_id, now)

    def restart_leases(self, now: float) -> None:
        """After a replay: times in replayed events are the dead process's clock; reset them."""
        for g in self.running.values():
            g.admitted_at = now
        self.leases = {}
        for g in self.running.values():
            self.touch(g.worker_id, now)
