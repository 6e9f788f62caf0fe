"""CPU seconds each local role used, read from /proc: the evidence for where roles are placed.

Every role runs in its own process group (the supervisor starts it in a new session), so a
role's CPU is the sum over the processes of its group — the reward service's grader workers
and sandboxes included — of user + system time, plus what its exited children left in
`cutime`/`cstime`. Sampled at most once a second (the supervisor's poll) and when roles stop;
a role restarted under the same name adds its new process group's time. On a system without
/proc nothing is recorded.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_seconds(pgids: set[int], proc: Path = Path("/proc")) -> dict[int, float]:
    """pgid -> CPU seconds of all live processes in that process group (with reaped children)."""
    out: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return out
    for pid in entries:
        try:
            text = (proc / pid / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = text.rpartition(")")[2].split()
        if len(fields) < 15:
            continue
        pgrp = int(fields[2])
        if pgrp in pgids:
            ticks = sum(int(x) for x in fields[11:15])
            out[pgrp] = out.get(pgrp, 0.0) + ticks / _TICK
    return out


class RoleCpuMeter:
    """Accumulates CPU seconds per role name from periodic samples of its process group."""

    def __init__(self, every_s: float = 1.0, proc: Path = Path("/proc")):
        self.every_s = every_s
        self.proc = proc
        self._last = -float("inf")
        # (role, pgid) -> the largest total seen for that process group.
        self._groups: dict[tuple[str, int], float] = {}

    def sample(self, pids: dict[str, int], force: bool = False) -> None:
        """`pids`: role name -> pid of its group leader (= the group id)."""
        now = time.monotonic()
        if not pids or (not force and now - self._last < self.every_s):
            return
        self._last = now
        totals = group_cpu_seconds(set(pids.values()), self.proc)
        for name, pid in pids.items():
            if pid in totals:
                key = (name, pid)
                self._groups[key] = max(self._groups.get(key, 0.0), totals[pid])

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (name, _), s in self._groups.items():
            out[name] = out.get(name, 0.0) + s
        return {k: round(v, 2) for k, v in sorted(out.items())}
