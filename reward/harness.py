"""The test harness that runs INSIDE the sandbox (stdlib only; started with `python -I -S`).

It reads the task (program, inputs, limits) on stdin, applies the limits, drops to the sandbox
user, runs the untrusted program in forked children, ends every process the program started,
and only then reads the expected outputs (the second message on stdin) and judges. No process
of the program ever exists while an expected output is in the harness's memory, so none can
find one in the memory it inherited or read it from the harness; and no child holds the report
channel, so a program can fail tests but cannot report a pass: exiting early, killing its
parent or printing fake results all end in tests without a result, which are failures.

Messages in are length-prefixed `marshal` data, the report out is `marshal` data (built in;
importing json would cost ~10 ms of every sandbox start): report = {"tests": [{"passed",
"status", ...}], "uid"} on the harness's stdout.
"""
import _ctypes  # not `ctypes`: its Python half costs ~3.5 ms of every start
import _signal as signal  # the C module: `signal` imports enum, ~5 ms of every start
import io
import marshal
import math
import os
import resource
import select
import sys
import time

SNIPPET = 200
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
    # The hard limit leaves room for the largest stdin a child writes into its memory file
    # before it lowers both limits to the program's (see _child_io).
    biggest = max((len(_as_text(x).encode()) for x in task["inputs"]), default=0) if not task.get("fn_name") else 0
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], max(lim["fsize_bytes"], biggest + 4096)))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    cpu = int(math.ceil(task["total_timeout"])) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


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


def _child_io(stdin_text, out_fd, err_fd):
    """In a forked child: fd 0 = the test input, fd 1/2 = our pipes (or /dev/null)."""
    os.setpgid(0, 0)
    if stdin_text is None:
        fd0 = os.open(os.devnull, os.O_RDONLY)
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        fd0 = os.memfd_create("stdin")
        data = stdin_text.encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd0, view):]
        os.lseek(fd0, 0, os.SEEK_SET)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, soft))
    os.dup2(fd0, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _read(fds, deadline, cap):
    """Read pipes until all close, the deadline passes or `cap` bytes arrive.
    Returns ({fd: bytes}, why) with why in (None, "timeout", "output limit")."""
    bufs = {fd: bytearray() for fd in fds}
    open_fds = list(fds)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return bufs, "timeout"
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            bufs[fd] += chunk
            if sum(len(b) for b in bufs.values()) > cap:
                return bufs, "output limit"
    return bufs, None


def _is_int(token):
    digits = token[1:] if token[:1] in ("+", "-") else token
    return digits.isascii() and digits.isdigit()


def _tokens_match(got, expected):
    """Token by token; an expected integer must come back as that integer exactly (a relative
    tolerance would pass 123456790 for 123456789, 1e18 for 10**18 + 1), only an expected
    decimal is compared with a tolerance."""
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if _is_int(y):
            if not (_is_int(x) and int(x) == int(y)):
                return False
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def _as_text(v):
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


def _run_stdio(task, deadline):
    """One forked child per test; each run's stdout is its answer."""
    results = []
    cap = task["max_output"]
    for test_input in task["inputs"]:
        if time.monotonic() >= deadline:
            results.append({"passed": False, "status": "skipped: total time limit"})
            continue
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                _child_io(_as_text(test_input), out_w, err_w)
                _cpu_limit(task["test_timeout"])
                exec(compile(task["program"], "<solution>", "exec"), _namespace(task, "__main__"))
                code = 0
            except SystemExit as e:
                code = 0 if e.code in (None, 0) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(out_w)
        os.close(err_w)
        bufs, why = _read([out_r, err_r], min(deadline, t0 + task["test_timeout"]), cap)
        os.close(out_r)
        os.close(err_r)
        status = _status_after(pid, why)
        results.append({"status": status, "seconds": round(time.monotonic() - t0, 4),
                        "answer": bufs[out_r].decode(errors="replace"),
                        "stderr": bufs[err_r].decode(errors="replace")[-SNIPPET:]})
    return results


def _status_after(pid, why):
    """Kill what is left of the test's process group and say how the test ended."""
    if why is not None:
        _kill_group(pid)
        return why
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers it forked
    except OSError:
        pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        names = {signal.SIGXCPU: "cpu time limit", signal.SIGKILL: "killed (SIGKILL)",
                 signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGXFSZ: "file size limit"}
        return names.get(sig, f"killed by signal {sig}")
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else f"runtime error (exit {code})"


def _send(fd, obj):
    data = marshal.dumps(obj)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _call_child(task, start, wfd):
    """Child of call mode: load the program once, run tests from `start`, one frame each."""
    null = os.open(os.devnull, os.O_WRONLY)
    _child_io(None, null, null)
    _cpu_limit(task["test_timeout"] * (len(task["inputs"]) - start + 1))
    ns = _namespace(task, "solution")
    try:
        exec(compile(task["program"], "<solution>", "exec"), ns)
    except BaseException as e:  # SystemExit included: exiting while loading is a failure too
        _send(wfd, {"error": f"program failed to load: {type(e).__name__}: {e}"[:SNIPPET]})
        return
    name = task["fn_name"]
    # LiveCodeBench calls Solution().<name> whenever the program has a `class Solution`.
    lcb_solution = task.get("convention") == "livecodebench" and "class Solution" in task["program"]
    fn = None if lcb_solution else ns.get(name)
    if not callable(fn) and isinstance(ns.get("Solution"), type):
        fn = getattr(ns["Solution"](), name, None)
    if not callable(fn):
        _send(wfd, {"error": f"no function {name!r} nor Solution.{name}"})
        return
    for i in range(start, len(task["inputs"])):
        args = task["inputs"][i]
        args = args if isinstance(args, list) else [args]
        try:
            rec = {"i": i, "value": fn(*args)}
            marshal.dumps(rec)
        except BaseException as e:  # SystemExit, exceptions, uncomparable results: a failed test
            rec = {"i": i, "error": f"{type(e).__name__}: {e}"[:SNIPPET]}
        _send(wfd, rec)


def _same(a, b):
    """`a` (returned) equals `b` (expected): floats within a tolerance, but only numbers (not
    "0.5" or True for 0.5), and an expected int exactly (3.0 for 3, not 3.0000001)."""
    if isinstance(a, float) or isinstance(b, float):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return False
        if isinstance(b, int):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _run_call(task, deadline):
    """One forked child loads the program and calls it per test (a new one after a failure)."""
    n = len(task["inputs"])
    results = [None] * n
    i = 0
    while i < n:
        if time.monotonic() >= deadline:
            results[i] = {"passed": False, "status": "skipped: total time limit"}
            i += 1
            continue
        r, w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _call_child(task, i, w)
            except BaseException:
                pass
            finally:
                os._exit(0)
        os.close(w)
        buf = b""
        t0 = time.monotonic()
        why = None
        while i < n:
            end = min(deadline, t0 + task["test_timeout"])
            while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
                left = end - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    why = "timeout"
                    break
                chunk = os.read(r, 65536)
                if not chunk:
                    why = "no result: the program exited or crashed before reporting"
                    break
                buf += chunk
                if len(buf) > task["max_output"] + 4:
                    why = "output limit"
                    break
            if why:
                results[i] = {"passed": False, "status": why, "seconds": round(time.monotonic() - t0, 4)}
                i += 1
                break
            size = int.from_bytes(buf[:4], "big")
            frame, buf = buf[4:4 + size], buf[4 + size:]
            try:
                rec = marshal.loads(frame)
                rec = rec if isinstance(rec, dict) else {}
            except (ValueError, EOFError, TypeError):
                rec = {}
            if "error" in rec and "i" not in rec:
                results[i:] = [{"passed": False, "status": rec["error"]}] * (n - i)
                i = n
                break
            seconds = round(time.monotonic() - t0, 4)
            if rec.get("i") != i:
                results[i] = {"passed": False, "status": "bad report from the program", "seconds": seconds}
            elif "error" in rec:
                results[i] = {"passed": False, "status": f"exception: {rec['error']}", "seconds": seconds}
            else:
                results[i] = {"status": "ok", "answer": rec.get("value"), "seconds": seconds}
            i += 1
            t0 = time.monotonic()
        os.close(r)
        _kill_group(pid)
    return results


def _lcb_same(a, b):
    """LiveCodeBench's rule for returned values: a tuple counts as a list, then `==`."""
    return (list(a) if isinstance(a, tuple) else a) == b


def _lcb_lines_match(got, expected):
    """LiveCodeBench's rule for stdout: as many lines (each stripped) as expected; a line that
    differs as text must hold the same numbers, token for token, as exact decimals."""
    from decimal import Decimal, InvalidOperation
    a, b = ([line.strip() for line in t.strip().split("\n")] for t in (got, _as_text(expected)))
    if len(a) != len(b):
        return False
    try:
        return all(x == y or [Decimal(t) for t in x.split()] == [Decimal(t) for t in y.split()]
                   for x, y in zip(a, b, strict=True))
    except (InvalidOperation, ValueError):
        return False


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
    """A program's globals: its convention's names, with `from sys import *`'s stdin/stdout/stderr
    rebound to this child's streams (the harness's would buffer output that is never flushed)."""
    ns = {**task["namespace"], "__name__": name}
    if "stdin" in ns:
        ns.update(stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
    return ns


def _judge(task, runs, outputs):
    """Each run's answer against its expected output (the program is gone by now)."""
    call = bool(task.get("fn_name"))
    if task.get("convention") == "livecodebench":
        same = _lcb_same if call else _lcb_lines_match
    else:
        same = _same if call else (lambda got, expected: _tokens_match(got, _as_text(expected)))
    results = []
    for run, expected in zip(runs, outputs, strict=True):
        rec = {k: v for k, v in run.items() if k not in ("answer", "stderr")}
        rec["passed"] = False
        if run["status"] == "ok":
            answer = run["answer"]
            rec["passed"] = same(answer, expected)
            rec["status"] = "passed" if rec["passed"] else "wrong output"
        if not rec["passed"]:
            if "answer" in run:
                rec["got"] = (repr(run["answer"]) if call else run["answer"])[:SNIPPET]
            rec["expected"] = (repr(expected) if call else _as_text(expected))[:SNIPPET]
            if "stderr" in run:
                rec["stderr"] = run["stderr"]
        results.append(rec)
    return results


def _reap_descendants():
    """Kill every process that came back to us as subreaper, then reap them; False if some
    were still appearing after 50 rounds."""
    me = str(os.getpid())
    for _ in range(50):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if ppid == me:
                found = True
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
        if not found:
            return True
    return False


def _read_message():
    """One length-prefixed marshal message from fd 0, read exactly: a buffered reader would
    read ahead into the expected outputs, into memory that every test child inherits."""
    def exact(n):
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise EOFError("the task message is truncated")
            data += chunk
        return data
    return marshal.loads(exact(int.from_bytes(exact(4), "big")))


def main():
    task = _read_message()
    os.chdir(task["workdir"])
    if task.get("packages"):          # the allowed packages bound into the sandbox
        sys.path.append(task["packages"])
    _limits(task)
    _drop_privileges(task.get("uid"))
    _prctl()
    deadline = time.monotonic() + task["total_timeout"]
    run = _run_call if task.get("fn_name") else _run_stdio
    # The first compile() of a process costs ~1.5 ms (this interpreter's parser warming up);
    # paid here once instead of in every forked test.
    compile("", "<warm-up>", "exec")
    task["namespace"] = _prelude(task)
    runs = run(task, deadline)
    if _reap_descendants():
        results = _judge(task, runs, _read_message())
    else:
        results = [{"passed": False, "status": "the program's processes could not all be stopped"}] * len(runs)
    sys.stdout.buffer.write(marshal.dumps({"tests": results, "uid": os.getuid()}))
    sys.stdout.flush()
    os._exit(0)   # nothing left to clean up: skip the interpreter's ~1 ms of finalisation


if __name__ == "__main__":
    main()
