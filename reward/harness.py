"""The test harness that runs INSIDE the sandbox (stdlib only; started with `python -I -S`).

It is compiled together with `reward/harness_judge.py` (the comparison rules),
`harness_procs.py` (the watch, the processes a test leaves) and `harness_call.py` (call mode),
and talks to the grader on two descriptors whose numbers it gets as arguments: the task channel (frames in) and
the report channel (one report out). Its standard streams are `/dev/null` and bubblewrap's pid 1
holds only those: under a non-root grader the program runs as the harness's own user and could
open any descriptor of a dumpable process of that user (`/proc/1/fd/N`), so no such process holds
a channel. The harness itself is not dumpable, and each test's child closes both channels first.

Frames on the task channel, in order: the task (program, limits, deadline), one frame per test
input, the expected outputs. Inputs are moved from the channel to the test that needs them with
`splice` (into the test's stdin file, or its call-mode feed pipe), never through this process's
memory, so no process that runs the program's code ever holds another test's input (a program
on a visible test could otherwise print the hidden ones, and multi-turn feedback would show them
to the model). The expected outputs are read only after every process of the program is gone,
so none can find one in memory it inherited or read it from the harness; no child holds the
report channel, so a program can fail tests but cannot report a pass.

A test ends when its process exits, or at its deadline (per test and for the task as a whole,
an absolute time on the grader's clock) — a program that closes its pipes and sleeps, or stops
itself, is killed then, not waited for.
"""
# ruff: noqa: F821 (the judge's and call mode's names: the three files are compiled as one (reward/sandbox.py))
import _ctypes  # not `ctypes`: its Python half costs ~3.5 ms of every start
import _signal as signal  # the C module: `signal` imports enum, ~5 ms of every start
import atexit
import builtins
import io
import marshal
import math
import os
import resource
import select
import sys
import time

# Time the harness keeps, before the task's deadline, to stop the program and report.
REPORT_RESERVE_S = 0.05
# Seconds past the task's deadline the harness may still spend making sure nothing of the program
# runs (the grader waits sandbox.REPORT_GRACE_S, 0.08 s, past it for the report).
REAP_GRACE_S = 0.05
# Seconds a test's leftover processes may take to be killed and reaped before the next test.
LEFTOVERS_S = 1.0
# Open descriptors per process (see _limits).
MAX_FILES = 64
# What LiveCodeBench's official grader (lcb_runner/evaluation/testing_util.py) gives every
# program: these modules imported and their names in scope (`from typing import *` too), and
# a recursion limit of 50,000. Programs written for it use `deque` or `List[int]` unimported.
LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
               "statistics", "itertools", "functools", "operator", "io", "sys", "json")
LCB_PRELUDE = "".join(f"from {m} import *\n" for m in (*LCB_MODULES, "builtins", "typing")) + \
    "".join(f"import {m}\n" for m in LCB_MODULES)


def _limits(task):
    lim = task["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"]))
    # The hard limit leaves room for the largest stdin the harness writes into a file (raised
    # for that copy only, see _stdin_file).
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], max(lim["fsize_bytes"], lim["stdin_bytes"] + 4096)))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    cpu = int(math.ceil(task["total_timeout"])) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # Few descriptors: each socket or pipe holds a kernel buffer no process's memory shows
    # (sandbox_seccomp.py keeps each at its default size), and the kernel caps descriptors in
    # flight (sent over a socket, then closed) per user by this limit too.
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_FILES, MAX_FILES))


def _cpu_limit(seconds):
    """Lower this process's CPU-seconds limit (never above what the harness itself got)."""
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(math.ceil(seconds)) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard - 1)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1 if hard == resource.RLIM_INFINITY else hard))


def _drop_privileges(uid):
    if uid is None or os.getuid() != 0:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


class _CInt(_ctypes._SimpleCData):
    _type_ = "i"


class _CFunction(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _CInt


class _Libc:
    _handle = _ctypes.dlopen(None, os.RTLD_NOW)


def _prctl():
    """Not dumpable (same-user children cannot ptrace us or open /proc/<harness>/fd), and a
    subreaper (orphaned descendants come back to us, so we can kill them before judging)."""
    prctl = _CFunction(("prctl", _Libc))
    prctl(4, 0, 0, 0, 0)    # PR_SET_DUMPABLE 0
    prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


class _Quitter:
    """`exit()` and `quit()` as the `site` module defines them (`-S` skips `site`)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        try:
            sys.stdin.close()
        except BaseException:
            pass
        raise SystemExit(code)


# ---- frames on the task channel -------------------------------------------------------------

def _exact(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the task channel closed early")
        data += chunk
    return data


def _frame_size(fd):
    return int.from_bytes(_exact(fd, 4), "big")


def _read_frame(fd):
    """One length-prefixed marshal frame, read exactly (never ahead into the next frame)."""
    return marshal.loads(_exact(fd, _frame_size(fd)))


def _move(src, dst, n, deadline=None, watch=None):
    """Move `n` bytes from pipe `src` to `dst` with splice (kernel to kernel: the bytes never
    enter this process's memory). With a deadline, `dst` is a non-blocking pipe and the move
    gives up when its reader does not keep up in time. Returns the bytes not moved (0: all)."""
    while n:
        if deadline is not None and _wait([], deadline, watch, [dst])[2]:
            return n
        try:
            moved = os.splice(src, dst, min(n, 1 << 20))
        except BlockingIOError:
            continue
        except BrokenPipeError:        # the reader is gone; nothing of this chunk was moved
            return n
        if moved == 0:
            raise EOFError("the task channel closed early")
        n -= moved
    return 0


def _skip_frame(fd, null_fd):
    _move(fd, null_fd, _frame_size(fd))


# ---- one test's process ---------------------------------------------------------------------

def _stdin_file(task_fd, n):
    """The next input frame, moved into a fresh unnamed file in /tmp (the sandbox's capped
    tmpfs; no memfd: the seccomp filter refuses those): the stdin of one test's child only."""
    fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    try:
        _move(task_fd, fd, n)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, soft))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _child_start(channels, stdin_fd, out_fd, err_fd):
    """In a forked child, before any of the program's code: close the harness's channels, then
    fd 0 = the test's input, fd 1/2 = our pipes (or /dev/null)."""
    for fd in channels:
        os.close(fd)
    os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    # A script that writes to sys.__stdout__ writes to its standard output.
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _finish_like_python():
    """What the interpreter does when a script ends: wait for its non-daemon threads, run its
    atexit handlers, flush its streams (os._exit, which ends every test child, does none)."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def _wait(fds, end, watch, write=()):
    """select() on `fds` until `end`, waking every tick to check the sandbox's memory:
    (readable, writable, why) with why None, "timeout" or the memory status."""
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return [], [], "timeout"
        r, w, _ = select.select(fds, write, [], min(left, watch.TICK_S) if watch else left)
        why = watch.over() if watch else None
        if why:
            return [], [], why
        if r or w:
            return r, w, None


def _await_stdio_test(pid, fds, end, cap, watch):
    """Read the child's pipes until it exits, `end` passes or `cap` bytes arrive, whoever holds
    the pipes. Returns ({fd: bytes}, exit status or None, why) with why in (None, "timeout",
    "output limit", the memory status)."""
    bufs = {fd: bytearray() for fd in fds}
    open_fds = list(fds)
    pidfd = os.pidfd_open(pid)
    status = None
    try:
        while status is None:
            ready, _, why = _wait([*open_fds, pidfd], end, watch)
            if why:
                return bufs, None, why
            for fd in ready:
                if fd == pidfd:
                    status = os.waitpid(pid, 0)[1]
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                    continue
                bufs[fd] += chunk
                if sum(len(b) for b in bufs.values()) > cap:
                    return bufs, None, "output limit"
        for fd in open_fds:     # what it wrote before exiting; nobody else's writes are waited for
            os.set_blocking(fd, False)
            try:
                while chunk := os.read(fd, 65536):
                    bufs[fd] += chunk
                    if sum(len(b) for b in bufs.values()) > cap:
                        return bufs, status, "output limit"
            except BlockingIOError:
                pass
        return bufs, status, None
    finally:
        os.close(pidfd)


def _status(pid, status, why):
    """Kill what is left of the test's process group and say how the test ended."""
    _kill_group(pid)
    if why is not None:
        return why
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        names = {signal.SIGXCPU: "cpu time limit", signal.SIGKILL: "killed (SIGKILL)",
                 signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGXFSZ: "file size limit"}
        return names.get(sig, f"killed by signal {sig}")
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else f"runtime error (exit {code})"


def _run_stdio(task, io_fds, deadline):
    """One forked child per test, its input in a file; each run's stdout is its answer."""
    task_fd, report_fd, null_fd = io_fds
    results = []
    for _ in range(task["n"]):
        if time.monotonic() >= deadline:
            _skip_frame(task_fd, null_fd)
            results.append({"passed": False, "status": "skipped: total time limit"})
            continue
        stdin_fd = _stdin_file(task_fd, _frame_size(task_fd))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                _child_start((task_fd, report_fd), stdin_fd, out_w, err_w)
                _cpu_limit(task["test_timeout"])
                try:
                    exec(compile(task["program"], "<solution>", "exec"), _namespace(task, "__main__"))
                    code = 0
                except SystemExit as e:
                    code = 0 if e.code in (None, 0) else 1
                    if e.code is not None and not isinstance(e.code, int):
                        print(e.code, file=sys.stderr)
                except BaseException:
                    import traceback
                    traceback.print_exc()
                _finish_like_python()
            finally:
                os._exit(code)
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
        bufs, status, why = _await_stdio_test(pid, [out_r, err_r], min(deadline, t0 + task["test_timeout"]),
                                              task["max_output"], task["watch"])
        os.close(out_r)
        os.close(err_r)
        results.append({"status": _status(pid, status, why), "seconds": round(time.monotonic() - t0, 4),
                        "answer": bufs[out_r].decode(errors="replace"),
                        "stderr": bufs[err_r].decode(errors="replace")[-SNIPPET:]})
        _stop_leftovers(until=min(deadline, time.monotonic() + LEFTOVERS_S))   # harness_procs.py
    return results


def _prelude(task):
    """The names a program starts with under its tests' convention, imported here once, before
    any test forks, so that no test pays for them."""
    if task.get("convention") != "livecodebench":
        return {}
    ns = {}
    exec(LCB_PRELUDE, ns)
    sys.setrecursionlimit(50000)
    return ns


def _namespace(task, name):
    """A program's globals: the dict of a module registered as `name` (`__main__` for a script,
    so that what it defines can be pickled by name, as multiprocessing does), holding its
    convention's names, with `from sys import *`'s stdin/stdout/stderr rebound to this child's
    streams (the harness's would buffer output that is never flushed)."""
    module = type(sys)(name)
    sys.modules[name] = module
    ns = module.__dict__
    ns.update(task["namespace"])
    ns.update(__name__=name, __file__="solution.py", __builtins__=builtins)
    if "stdin" in ns:
        ns.update(stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
    return ns


def main():
    task_fd, report_fd = int(sys.argv[1]), int(sys.argv[2])
    sys.argv = ["solution.py"]        # what a program run as a script sees
    null_fd = os.open(os.devnull, os.O_WRONLY)
    task = _read_frame(task_fd)
    os.chdir(task["workdir"])
    if task.get("packages"):          # the allowed packages bound into the sandbox
        sys.path.append(task["packages"])
    _limits(task)
    _drop_privileges(task.get("uid"))
    _prctl()
    builtins.exit, builtins.quit = _Quitter("exit"), _Quitter("quit")
    deadline = task["deadline"] - REPORT_RESERVE_S
    run = _run_call if task.get("fn_name") else _run_stdio
    # The first compile() of a process costs ~1.5 ms (this interpreter's parser warming up);
    # paid here once instead of in every forked test.
    compile("", "<warm-up>", "exec")
    task["namespace"] = _prelude(task)
    watch = task.get("watch")      # {"memory_bytes", "processes"} where no cgroup counts them
    task["watch"] = _SandboxWatch(watch["memory_bytes"], watch["processes"]) if watch else None
    runs = run(task, (task_fd, report_fd, null_fd), deadline)
    if _stop_leftovers(until=task["deadline"] + REAP_GRACE_S):
        results = _judge(task, runs, _read_frame(task_fd))
    else:
        results = [{"passed": False, "status": "the program's processes could not all be stopped"}] * len(runs)
    report = marshal.dumps({"tests": results, "uid": os.getuid()})
    while report:
        report = report[os.write(report_fd, report):]
    os._exit(0)   # nothing left to clean up: skip the interpreter's ~1 ms of finalisation


if __name__ == "__main__":
    main()
