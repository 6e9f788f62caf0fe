"""The program's processes as the harness sees them (compiled with harness.py, runs inside the
sandbox; stdlib only): the watch of the sandbox as a whole where no cgroup counts it, and the
processes a test leaves behind.

A test's processes do not outlive it. Each stdin/stdout test is a run of the program of its own,
so once its process has ended, everything it started is killed and reaped before the next test
(issue 61: a correct program that forked a worker per run and never waited for it left a zombie
per test, which counts against the process limit until reaped, and failed from the 15th test on;
a program that left spinning processes in sessions of their own kept them for the whole task,
slowing the other worker's tasks 3-4x). In call mode the loaded program persists between calls
(a pool it made at load time is its own), so what is killed after each call is what left the
loaded program's process group: a new session, an orphan reparented to the harness.
"""
# ruff: noqa: F821 (the harness's names: compiled as one with harness.py (reward/sandbox.py))
import _signal as signal
import os
import time


class _SandboxWatch:
    """The sandbox's memory and process count as a whole where no cgroup counts them (a
    non-root grader without a delegated cgroup): every `TICK_S` while a test runs, the processes
    in the sandbox's PID namespace but bwrap's init and the harness, and their anonymous and
    shared memory (RssAnon + RssShmem), against the task's limits. A zombie holds neither memory
    nor CPU and is not counted (it is reaped after its test). Pages a child still shares with the
    harness after fork count once per process (a few MiB each: an overestimate, never an
    escape). The kernel's own per-user process limit applies too. Memory no process maps (socket
    and pipe buffers) is bounded by the seccomp filter and the descriptor limit instead
    (sandbox_seccomp.py)."""
    TICK_S = 0.02

    def __init__(self, memory_bytes, processes):
        self.memory, self.processes = memory_bytes, processes
        self.skip = {"1", str(os.getpid())}

    def over(self):
        """None, or the limit the sandbox is past."""
        total, count = 0, 0
        for name in os.listdir("/proc"):
            if not name.isdigit() or name in self.skip:
                continue
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    status = f.read()
            except OSError:
                continue
            if b"State:\tZ" in status:
                continue
            count += 1
            if count > self.processes:
                return PROCESS_STATUS
            for key in (b"RssAnon:", b"RssShmem:"):
                at = status.find(key)
                if at >= 0:
                    total += int(status[at + len(key):status.index(b"kB", at)]) << 10
        return MEMORY_STATUS if total > self.memory else None


MEMORY_STATUS = "memory limit (all the sandbox's processes together)"
PROCESS_STATUS = "process limit (all the sandbox's processes together)"


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _processes():
    """{pid: (parent, process group, state)} of every process in sight."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(name)] = (int(fields[1]), int(fields[2]), fields[0])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _stop_leftovers(until, keep_group=None):
    """Kill every descendant of the harness but the leader of process group `keep_group` (call
    mode's loaded program) and its children in that group, and reap what comes back to us as
    subreaper; False if some were still there at `until`. Zombies whose parent lives on are left
    to it (they hold nothing, and are its to wait for: in call mode a program that never waits
    for its children keeps them against the process limit, as anywhere). A killed
    process is not gone at once: one that holds 100 MiB (or that the cgroup's OOM killer is
    ending) takes milliseconds to free its memory, while a round here takes microseconds in the
    sandbox's small /proc, so rounds are bounded by time, with a pause between them."""
    me = os.getpid()
    while True:
        procs = _processes()
        children = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        todo, left = list(children.get(me, ())), False
        while todo:
            pid = todo.pop()
            todo += children.get(pid, ())
            ppid, group, state = procs[pid]
            # The loaded program and its own children stay; an orphan of its group does not.
            if (group == keep_group and (ppid != me or pid == keep_group)) or (state in "ZX" and ppid != me):
                continue
            left = True
            if state not in "ZX":
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
        if not left:
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(0.001)
