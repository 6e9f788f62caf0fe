"""The harness's call mode (compiled with harness.py, runs inside the sandbox; stdlib only).

Tests that name a function (`fn_name`) load the program once in a forked child and call the
function once per test. The child gets each input only when its test starts — on a feed pipe,
moved there by splice from the task channel, after the previous result came back — so the
program never holds an input of a test it has not been given (see harness.py). A child that
fails (timeout, crash, bad frame) is killed and the next test gets a fresh one.
"""
# ruff: noqa: F821 (the harness's names: compiled as one with harness.py and harness_judge.py (reward/sandbox.py))
import marshal
import os
import time


def _send(fd, obj):
    data = marshal.dumps(obj)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _call_child(task, feed_fd, wfd):
    """Child of call mode: load the program once, then one call per input frame on `feed_fd`
    (the harness feeds the next input only after this one's result)."""
    null = os.open(os.devnull, os.O_RDWR)
    _child_start((), null, null, null)
    _cpu_limit(task["test_timeout"] * (task["n"] + 1))
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
    _send(wfd, {"loaded": True})
    while True:
        try:
            i, args = _read_frame(feed_fd), _read_frame(feed_fd)
        except EOFError:
            return
        args = args if isinstance(args, list) else [args]
        try:
            rec = {"i": i, "value": fn(*args)}
            marshal.dumps(rec)
        except BaseException as e:  # SystemExit, exceptions, uncomparable results: a failed test
            rec = {"i": i, "error": f"{type(e).__name__}: {e}"[:SNIPPET]}
        _send(wfd, rec)


def _next_frame(r, buf, end, cap, watch):
    """(frame, rest of buf, why): the child's next result frame, read by `end`."""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        why = _wait([r], end, watch)[2]
        if why:
            return None, buf, why
        chunk = os.read(r, 65536)
        if not chunk:
            return None, buf, "no result: the program exited or crashed before reporting"
        buf += chunk
        if len(buf) > cap + 4:
            return None, buf, "output limit"
    size = int.from_bytes(buf[:4], "big")
    try:
        rec = marshal.loads(buf[4:4 + size])
    except (ValueError, EOFError, TypeError):
        rec = None
    return (rec if isinstance(rec, dict) else {}), buf[4 + size:], None


class _CallChild:
    """One call-mode child: its feed pipe (inputs in, one at a time) and result pipe."""

    def __init__(self, task, channels):
        feed_r, self.feed_w = os.pipe()
        self.res_r, res_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                for fd in (*channels, self.feed_w, self.res_r):
                    os.close(fd)
                _call_child(task, feed_r, res_w)
            except BaseException:
                pass
            finally:
                os._exit(0)
        os.close(feed_r)
        os.close(res_w)
        os.set_blocking(self.feed_w, False)
        self.buf = b""

    def close(self):
        os.close(self.feed_w)
        os.close(self.res_r)
        _kill_group(self.pid)


def _run_call(task, io_fds, deadline):
    """A forked child loads the program and is fed the inputs one by one (a new child after a
    failure); each result frame is the returned value."""
    task_fd, report_fd, null_fd = io_fds
    n, cap = task["n"], task["max_output"]
    results = [None] * n
    child = None
    for i in range(n):
        if results[i] is not None:          # answered by the child's load failure
            _skip_frame(task_fd, null_fd)
            continue
        if time.monotonic() >= deadline:
            _skip_frame(task_fd, null_fd)
            results[i] = {"passed": False, "status": "skipped: total time limit"}
            continue
        t0 = time.monotonic()
        end = min(deadline, t0 + task["test_timeout"])
        if child is None:
            child = _CallChild(task, (task_fd, report_fd))
            rec, child.buf, why = _next_frame(child.res_r, child.buf, end, cap, task["watch"])
            if why is None and not rec.get("loaded"):
                why = rec.get("error", "bad report from the program")
                results[i + 1:] = [{"passed": False, "status": why}] * (n - i - 1)
        else:
            why = None
        size = _frame_size(task_fd)
        if why is None:   # two frames: the test's index, then its input as the grader wrote it
            index = marshal.dumps(i)
            try:
                os.write(child.feed_w, len(index).to_bytes(4, "big") + index + size.to_bytes(4, "big"))
                size = _move(task_fd, child.feed_w, size, end, task["watch"])
            except OSError:
                why = "no result: the program exited or crashed before reporting"
            if size and why is None:
                why = "timeout" if time.monotonic() >= end else "no result: the program exited or crashed before reporting"
        if size:
            _move(task_fd, null_fd, size)
        rec = None
        if why is None:
            rec, child.buf, why = _next_frame(child.res_r, child.buf, end, cap, task["watch"])
        seconds = round(time.monotonic() - t0, 4)
        if why:
            results[i] = {"passed": False, "status": why, "seconds": seconds}
            child.close()
            child = None
        elif rec.get("i") != i:
            results[i] = {"passed": False, "status": "bad report from the program", "seconds": seconds}
        elif "error" in rec:
            results[i] = {"passed": False, "status": f"exception: {rec['error']}", "seconds": seconds}
        else:
            results[i] = {"status": "ok", "answer": rec.get("value"), "seconds": seconds}
        # What the call left outside the loaded program's process group (harness_procs.py).
        _stop_leftovers(min(deadline, time.monotonic() + LEFTOVERS_S), child.pid if child else None)
    if child is not None:
        child.close()
    return results
