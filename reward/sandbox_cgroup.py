"""Limits for a sandbox as a whole: one cgroup per task, for memory and process count.

Resource limits (`setrlimit`) hold per process: three processes hold three times the address
space limit, and memory that is no process's mapping at all — a memfd written to, files in the
sandbox's tmpfs — counts against none. A cgroup counts all of it (anonymous memory, memfds and
tmpfs pages are charged to the cgroup of the process that touched them), and its process
count covers every process and thread inside, whatever user runs it.

Where it comes from, in order:
- cgroup v2 (`cgroup2` mount) with the `memory` and `pids` controllers enabled in the grader's
  own cgroup's subtree (the unified layout; under a non-root grader this needs a delegated
  subtree, e.g. systemd's `Delegate=yes`): `memory.max`, `memory.swap.max`, `pids.max`, and
  `cgroup.kill` to end it;
- cgroup v1 (the `memory` hierarchy mounted and writable: the usual case for a root grader on
  a v1 or hybrid machine): `memory.limit_in_bytes` (+ `memory.memsw.limit_in_bytes` when swap
  accounting is on). No v1 `pids` cgroup: the process count is already exact there — a root
  grader runs each worker's programs as a user of their own, whose processes `RLIMIT_NPROC`
  counts;
- neither (a non-root grader without delegation): `available()` is False and the sandbox keeps
  its per-process limits, as every verdict's `limits` field says.

The sandbox puts bubblewrap's child into the cgroup before that child starts anything (bwrap's
`--info-fd` gives its pid and `--block-fd` holds it until then), so the harness and every
process of the program are born inside. That move is the cgroup's cost: the kernel waits for an
RCU grace period to move a process (about 11 ms here, of which the task start waits part:
benchmarks/sandbox_start.py shows the whole sandbox with and without). `reward.sandbox_cgroup:
false` trades the exact limit for that time (then the harness's watch counts the sandbox).
"""
from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
_COUNTER = itertools.count()


def _own_paths() -> dict[str, str]:
    """{controller or "": path} from /proc/self/cgroup ("" is the v2 hierarchy)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


@functools.cache
def layout() -> tuple[str, Path] | None:
    """("v2", parent) or ("v1", memory parent) where per-task cgroups can be made, or None.
    Found once per process."""
    try:
        own = _own_paths()
    except OSError:
        return None
    for mount in (_ROOT, _ROOT / "unified"):
        if "" in own and (mount / "cgroup.controllers").exists():
            parent = mount / own[""].lstrip("/")
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            if {"memory", "pids"} <= set(enabled) and _writable_dir(parent):
                return "v2", parent
    if "memory" in own:
        memory = _ROOT / "memory" / own["memory"].lstrip("/")
        if (memory / "memory.limit_in_bytes").exists() and _writable_dir(memory):
            return "v1", memory
    return None


def available() -> bool:
    return layout() is not None


def remove_stale() -> int:
    """Remove task cgroups left by graders that died mid-task (their pid in the name is gone);
    returns how many. Called once per process, before its first task."""
    if layout() is None:
        return 0
    kind, parent = layout()
    removed = 0
    for d in parent.glob("tandem-sbx-*-*"):
        try:
            os.kill(int(d.name.split("-")[2]), 0)
            continue                     # its grader is alive
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        SandboxCgroup(kind, d).close()
        removed += not d.exists()
    return removed


class SandboxCgroup:
    """One task's cgroup: limits set at creation, removed by `close`."""

    def __init__(self, kind: str, path: Path):
        self.kind, self.path = kind, path

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> SandboxCgroup:
        kind, parent = layout()
        self = cls(kind, parent / f"tandem-sbx-{os.getpid()}-{next(_COUNTER)}")
        self.path.mkdir()
        try:
            if kind == "v2":
                self._write(self.path / "memory.max", memory_bytes)
                self._write(self.path / "memory.swap.max", 0, optional=True)
                self._write(self.path / "pids.max", max_pids)
            else:
                self._write(self.path / "memory.limit_in_bytes", memory_bytes)
                self._write(self.path / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        except OSError:
            self.close()
            raise
        return self

    @staticmethod
    def _write(path: Path, value: int, optional: bool = False) -> None:
        try:
            path.write_text(str(value))
        except OSError:
            if not optional:
                raise

    def add(self, pid: int) -> None:
        """Move `pid` (not yet started anything) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_killed(self) -> bool:
        """Whether the memory limit killed a process of the task."""
        try:
            if self.kind == "v2":
                events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
                return int(events.get("oom_kill", 0)) > 0
            control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return int(control.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Kill whatever is still inside, then remove the cgroup (retried while the kernel
        finishes tearing the processes down; a leftover empty directory is harmless)."""
        if self.kind == "v2":
            try:
                (self.path / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(200):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                if self.path.exists():
                    self.path.rmdir()
                return
            except OSError:
                time.sleep(0.001)
