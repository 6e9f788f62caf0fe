"""What a program holds beyond its processes' memory, and what its processes leave between
tests (issue 61), with the grader as root and as an ordinary user with no writable cgroup.

Without a cgroup the harness's watch sums what each process maps; memory no process maps
(socket buffers, a tmpfs of the program's own in a user namespace, SysV message queues) is
bounded instead by refusing the way in (reward/sandbox_seccomp.py) and by the descriptor limit.
Each attack prints the expected output only if it held its memory; each legitimate program is
one plain `python solution.py` runs correctly. One batch per grader, shared by the tests.
"""
from __future__ import annotations

import pytest
from grader_users import USERS, run_as, why_not

# 12 MiB of memory, 256 MiB of a limit: what the attacks must not pass however they hold it.
CFG = {"code_test_timeout_s": 10.0, "code_total_timeout_s": 40.0, "code_memory_mb": 256}
HELD = r"""
import time
time.sleep(0.5)
print("ok" if held >= 300 << 20 else f"held {held >> 20} MiB: {why}")
"""
# 13 processes fill Unix socket pairs (asking for 4 MiB buffers), sending them over a carrier
# socket and closing them (descriptors in flight are no process's), until 300 MiB are queued.
SOCKETS = r"""
import array, os, socket
PROCS, SHARE = 12, (300 << 20) // 13 + 1
def fill(s):
    s.setblocking(False)
    n = 0
    try:
        while True:
            n += s.send(b"x" * 65536)
    except OSError:
        return n
def hold():
    total, keep, carrier = 0, [], socket.socketpair()
    carrier[0].setblocking(False)
    while total < SHARE:
        try:
            a, b = socket.socketpair()
        except OSError:
            break
        for s in (a, b):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
            except OSError:
                pass
        total += fill(a) + fill(b)
        try:
            carrier[0].sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [a.fileno(), b.fileno()]))])
            a.close()
            b.close()
        except OSError:
            keep.append((a, b))
    return total, keep, carrier
r, w = os.pipe()
go_r, go_w = os.pipe()
kids = []
for _ in range(PROCS):
    pid = os.fork()
    if pid == 0:
        mine = hold()
        os.write(w, mine[0].to_bytes(8, "big"))
        os._exit(0 if os.read(go_r, 1) == b"g" else 3)
    kids.append(pid)
held, keep, carrier = hold()
os.close(w)
for _ in range(PROCS):
    held += int.from_bytes(os.read(r, 8) or bytes(8), "big")
why = "sockets"
""" + HELD + r"""
os.write(go_w, b"g" * PROCS)
for pid in kids:
    os.waitpid(pid, 0)
"""
# A user namespace of its own (every capability in it), a tmpfs mounted there, 300 MiB written.
OWN_TMPFS = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl(4, 1, 0, 0, 0)          # dumpable again: its /proc/self is its own to write
NEWUSER, NEWNS = 0x10000000, 0x20000
SYS = {"x86_64": (272, 56), "aarch64": (97, 220)}[os.uname().machine]
uid, gid = os.getuid(), os.getgid()
held, why = 0, []
def fill():
    global held
    for path, data in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                       ("/proc/self/gid_map", f"0 {gid} 1")):
        with open(path, "w") as f:
            f.write(data)
    os.makedirs("/tmp/own", exist_ok=True)
    if libc.mount(b"none", b"/tmp/own", b"tmpfs", 0, b"size=2g") != 0:
        raise OSError(ctypes.get_errno(), "mount")
    for i in range(20):              # 15 MiB each: one file is capped, their sum is not
        with open(f"/tmp/own/{i}", "wb") as f:
            f.write(b"x" * (15 << 20))
        held += 15 << 20
for name, call in (("unshare", lambda: libc.unshare(NEWUSER | NEWNS)),
                   ("raw unshare", lambda: libc.syscall(SYS[0], NEWUSER | NEWNS))):
    if call() == 0:
        fill()
        break
    why.append(f"{name}: {os.strerror(ctypes.get_errno())}")
else:
    pid = libc.syscall(SYS[1], NEWUSER | NEWNS | 17, 0, 0, 0, 0)      # clone, SIGCHLD
    if pid == 0:
        fill()
        os._exit(0 if held >= 300 << 20 else 1)
    if pid > 0 and os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0:
        held = 300 << 20
    why.append(f"clone: {os.strerror(ctypes.get_errno())}")
""" + HELD
# SysV message queues: kernel memory, 16 KiB a queue, 32,000 queues an IPC namespace.
MESSAGE_QUEUES = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 8000)]
m = Msg(1, b"x" * 8000)
held, queues = 0, 0
while held < 300 << 20 and (q := libc.msgget(0, 0o1600)) >= 0:
    queues += 1
    while libc.msgsnd(q, ctypes.byref(m), 8000, 0o4000) == 0:
        held += 8000
why = f"{queues} queues: {os.strerror(ctypes.get_errno())}"
""" + HELD
# /dev/shm is writable now (multiprocessing needs it) and size-capped as /tmp is.
DEV_SHM = r"""
held, why = 0, ""
try:
    for i in range(20):
        with open(f"/dev/shm/f{i}", "wb") as f:
            f.write(b"x" * (15 << 20))
        held += 15 << 20
except OSError as e:
    why = str(e)
""" + HELD
ATTACKS = {"socket_buffers": SOCKETS, "own_tmpfs_in_a_user_namespace": OWN_TMPFS,
           "sysv_message_queues": MESSAGE_QUEUES, "dev_shm": DEV_SHM}

# Programs plain python runs (each prints 42 for the input 21).
LEGITIMATE = {
    "multiprocessing_pool": "import multiprocessing\ndef twice(x):\n    return 2 * x\n"
                            "if __name__ == '__main__':\n    with multiprocessing.Pool(2) as p:\n"
                            "        print(sum(p.map(twice, [int(input()), 0])))",
    "process_pool_executor": "from concurrent.futures import ProcessPoolExecutor\ndef twice(x):\n    return 2 * x\n"
                             "with ProcessPoolExecutor(2) as ex:\n    print(ex.submit(twice, int(input())).result())",
    "process_and_queue": "import multiprocessing as mp\ndef work(q, x):\n    q.put(2 * x)\nq = mp.Queue()\n"
                         "p = mp.Process(target=work, args=(q, int(input())))\np.start()\nprint(q.get())\np.join()",
    "pickled_main_function": "import pickle\ndef twice(x):\n    return 2 * x\nprint(pickle.loads(pickle.dumps(twice))(int(input())))",
    "asyncio_run": "import asyncio\nasync def twice(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
                   "print(asyncio.run(twice(int(input()))))",
    "subprocess_of_python": "import subprocess, sys\nx = int(input())\n"
                            "print(subprocess.run([sys.executable, '-c', f'print({x} * 2)'], capture_output=True, text=True).stdout.strip())",
}

# Processes a test leaves (issue 61): each run checks that nothing of an earlier run is alive
# (every process in sight but itself, the harness and bubblewrap's init), prints "clean", then
# leaves something behind. 20 tests each: zombies used to count against the process limit.
SEEN = "import os\nmine = {1, os.getpid(), os.getppid()}\nothers = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in mine]\n"
LEAVES = {
    "zombie_per_run": "if os.fork() == 0:\n    os._exit(0)",
    "worker_per_run_never_waited": "import time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)",
    "spinner_in_its_own_session": "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n"
                                  "            pass\n    os._exit(0)",
}
CALL_LEAVES = {    # call mode: the loaded program persists; what it leaves outside its group does not
    "orphan_spinner_per_call": "if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n            while True:\n"
                               "                pass\n        os._exit(0)\n    os.wait()",
    "orphan_sleeper_per_call": "import time\n    if os.fork() == 0:\n        if os.fork() == 0:\n            time.sleep(60)\n"
                               "        os._exit(0)\n    os.wait()",
}
N = 20


def _call_program(leave: str) -> str:
    return ("import os\ndef f(x):\n    mine = {1, os.getpid(), os.getppid()}\n"
            "    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in mine]\n"
            f"    {leave}\n    return 'leftover' if others else 'clean'")


@pytest.fixture(scope="module", params=USERS)
def graded(request):
    reason = why_not(request.param)
    if reason:
        pytest.skip(reason)
    cases = [{"program": p, "inputs": [""], "outputs": ["ok"]} for p in ATTACKS.values()]
    cases += [{"program": p, "inputs": ["21"], "outputs": ["42"]} for p in LEGITIMATE.values()]
    cases += [{"program": SEEN + leave + "\nprint('leftover' if others else 'clean')", "inputs": [""] * N,
               "outputs": ["clean"] * N} for leave in LEAVES.values()]
    cases += [{"program": _call_program(leave), "inputs": [[i] for i in range(N)], "outputs": ["clean"] * N,
               "fn_name": "f"} for leave in CALL_LEAVES.values()]
    results = run_as(request.param, cases, CFG)
    return {"user": request.param, **dict(zip([*ATTACKS, *LEGITIMATE, *LEAVES, *CALL_LEAVES], results, strict=True))}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_memory_no_process_shows_is_not_held_past_the_limit(graded, name):
    r = graded[name]
    assert r["error"] is None and not r["tests"][0]["passed"], (graded["user"], name, r)


def test_the_way_in_is_closed(graded):
    """Refused at the system call, not merely outlasted: no namespace, no queue, Unix sockets
    at their default buffers only, /dev/shm full at its cap."""
    assert "Function not implemented" in graded["own_tmpfs_in_a_user_namespace"]["tests"][0]["got"]
    assert "Function not implemented" in graded["sysv_message_queues"]["tests"][0]["got"]
    assert "No space left" in graded["dev_shm"]["tests"][0]["got"]
    assert graded["socket_buffers"]["tests"][0]["got"].startswith("held")


@pytest.mark.parametrize("name", list(LEGITIMATE))
def test_programs_that_start_processes_behave_as_under_plain_python(graded, name):
    r = graded[name]
    assert r["error"] is None and r["tests"][0]["passed"], (graded["user"], name, r)


@pytest.mark.parametrize("name", [*LEAVES, *CALL_LEAVES])
def test_what_a_test_leaves_is_gone_before_the_next(graded, name):
    r = graded[name]
    assert r["error"] is None and [t["status"] for t in r["tests"]] == ["passed"] * N, (graded["user"], name, r)
