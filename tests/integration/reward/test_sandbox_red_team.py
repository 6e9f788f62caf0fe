"""The code sandbox attacked as a policy would, with the grader as root and as an ordinary user.

Each attack is written so that its test would PASS if the attack worked (the program prints the
expected output only when it forged, stole or exceeded something); each legitimate program is
one a normal `python solution.py` runs correctly. Every case runs under both graders
(tests/support/grader_users.py): as root in this process, and as an unprivileged user in a user
namespace, which is how clusters run the reward service and where the first forgery was found
(a report written into bubblewrap's pid 1's stdout). One batch per grader, shared by the tests.
"""
from __future__ import annotations

import os
import tempfile

import pytest
from grader_users import USERS, run_as, why_not
from reward_service_helpers import scan_own_memory

from tandem.reward.config import RewardConfig
from tandem.reward.harness_procs import MEMORY_STATUS
from tandem.reward.sandbox import Sandbox

CFG = {"code_test_timeout_s": 2.0, "code_total_timeout_s": 8.0, "code_memory_mb": 256}
SECRET = "expected-53117"
HIDDEN = "HIDDEN-INPUT-90210"
# Its own memory, and every string object the harness left in it.
SCAN_OWN_MEMORY = scan_own_memory("HIDDEN-INPUT-[0-9]+") + r"""
import gc
found = [found] + [o for o in gc.get_objects() if isinstance(o, str) and "HIDDEN-INPUT" in o]
leak = next((x for x in found if x != "none"), "none")
"""
# Every descriptor of every process the program can open, for writing (a forged report in the
# harness's own format) or for reading (whatever the grader sent: tests, expected outputs).
FORGE_EVERY_FD = r"""
import marshal, os
fake = marshal.dumps({"tests": [{"passed": True, "status": "passed"}], "uid": 0})
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for fd in os.listdir(f"/proc/{pid}/fd") if os.access(f"/proc/{pid}/fd", os.R_OK) else []:
            try:
                w = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                os.write(w, fake)
            except OSError:
                pass
print("forged")
"""
READ_EVERY_FD = r"""
import os, re
seen = b""
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        for fd in os.listdir(f"/proc/{pid}/fd") if os.access(f"/proc/{pid}/fd", os.R_OK) else []:
            try:
                r = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
                seen += os.read(r, 1 << 20)
            except OSError:
                pass
m = re.search(rb"expected-[0-9]+", seen)
print(m.group(0).decode() if m else "nothing")
"""
# Proof that three processes held 100 MiB each together for `HOLD_S`: each child, once it holds
# its block, says so and waits to be released; the parent, holding its own, waits, releases them
# and prints "ok" only if both exit normally (a child the OOM killer ended after saying so exits on
# SIGKILL: an earlier version counted it as held, and "passed" whenever the killer picked such a
# child). A cgroup refuses the third block outright; without one the harness's watch samples the
# sandbox every 20 ms, and a version that released at once passed 1 run in 30 as the ordinary
# user: the sum can pass the limit between two samples by what the processes touch in one (the
# documented bound, docs/reward.md), so the attack holds its memory across many.
HOLD_MEMORY = r"""
import os, time
MB, HOLD_S = 100, 0.5
held_r, held_w = os.pipe()
go_r, go_w = os.pipe()
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        block = bytearray(MB << 20)
        os.write(held_w, b"x")
        os._exit(0 if os.read(go_r, 1) == b"g" else 3)
    children.append(pid)
block = bytearray(MB << 20)
os.close(held_w)
held = b""
while len(held) < 2 and (chunk := os.read(held_r, 1)):
    held += chunk
time.sleep(HOLD_S)
os.write(go_w, b"gg")
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print("ok" if len(held) == 2 and codes == [0, 0] else f"killed {codes}")
"""
KEYCTL = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
SYS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[__import__("os").uname().machine]
"""
ATTACKS = {
    "forge_report_through_any_fd": (FORGE_EVERY_FD, [""], [SECRET], None),
    "expected_outputs_from_any_fd": (READ_EVERY_FD, ["x"], [SECRET], None),
    "hidden_input_from_memory_stdio": (SCAN_OWN_MEMORY + "print(leak)", ["visible", HIDDEN], [HIDDEN, "x"], None),
    "hidden_input_from_memory_call": (SCAN_OWN_MEMORY + "def f(x):\n    return leak",
                                      [["visible"], [HIDDEN]], [HIDDEN, "x"], "f"),
    "three_processes_hold_300_MiB_of_256": (HOLD_MEMORY, [""], ["ok"], None),
    "memfds_past_the_memory_limit": ("import os\nfds = []\nfor _ in range(20):\n    fd = os.memfd_create('x')\n"
                                     "    os.write(fd, b'x' * (15 << 20))\n    fds.append(fd)\nprint('ok')", [""], ["ok"], None),
    "files_past_the_disk_limit": ("for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))\nprint('ok')",
                                  [""], ["ok"], None),
    "stop_the_harness": ("import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\nexcept OSError:\n    pass\n"
                         f"print({SECRET!r})", [""], ["never"], None),
    "keyring_write": (KEYCTL + "k = libc.syscall(SYS[0], b'user', b'tandem-red-team', b'" + SECRET +
                      "', 14, -4)\nprint('stored' if k > 0 else 'refused')", [""], ["stored"], None),
    # Run after keyring_write by the same grader: finds what an earlier task left in the keyring.
    "keyring_read": (KEYCTL + "k = libc.syscall(SYS[1], b'user', b'tandem-red-team', None, 0)\n"
                     "buf = ctypes.create_string_buffer(64)\nn = libc.syscall(SYS[2], 11, k, buf, 64) if k > 0 else -1\n"
                     "print(buf.raw[:n].decode() if n > 0 else 'none')", [""], [SECRET], None),
}
LEGITIMATE = {
    "exit_builtin": ("print(42)\nexit()", "42"),
    "quit_builtin": ("print(42)\nquit(0)", "42"),
    "thread_not_joined": ("import threading, time\ndef late():\n    time.sleep(0.2)\n    print(42)\n"
                          "threading.Thread(target=late).start()", "42"),
    "atexit_handler": ("import atexit\natexit.register(lambda: print(42))", "42"),
    "dunder_stdout": ("import sys\nsys.__stdout__.write('42\\n')", "42"),
    "argv_like_a_script": ("import sys\nif len(sys.argv) > 1:\n    sys.stdin = open(sys.argv[1])\nprint(int(input()) * 2)", "42"),
    "tempfile_in_tmp": ("import tempfile\nwith tempfile.TemporaryFile() as f:\n    f.write(b'42')\n    f.seek(0)\n"
                        "    print(f.read().decode())", "42"),
    "deep_directories": ("import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nprint(42)", "42"),
    "closes_its_streams_and_exits": ("import os\nprint(42, flush=True)\nos.close(1)\nos.close(2)", "42"),
}


@pytest.fixture(scope="module", params=USERS)
def graded(request):
    """{case name: SandboxResult as a dict} of every attack and legitimate program, one grader."""
    reason = why_not(request.param)
    if reason:
        pytest.skip(reason)
    cases = [{"program": p, "inputs": i, "outputs": o, "fn_name": fn} for p, i, o, fn in ATTACKS.values()]
    cases += [{"program": p, "inputs": ["21"], "outputs": [out]} for p, out in LEGITIMATE.values()]
    cases.append({"program": "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", "inputs": [""], "outputs": ["x"]})
    results = run_as(request.param, cases, CFG)
    return {"user": request.param, **dict(zip([*ATTACKS, *LEGITIMATE, "closed_pipes_then_sleep"], results, strict=True))}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_every_attack_fails(graded, name):
    r = graded[name]
    assert not any(t.get("passed") for t in r["tests"]), (graded["user"], name, r)


def test_the_forged_report_reached_no_channel(graded):
    """The forger ran (it printed), its report went nowhere, and the real report came back."""
    r = graded["forge_report_through_any_fd"]
    assert r["error"] is None and r["tests"][0]["got"].strip() == "forged", r


def test_no_process_running_the_program_holds_a_hidden_input(graded):
    for name in ("hidden_input_from_memory_stdio", "hidden_input_from_memory_call"):
        first = graded[name]["tests"][0]
        assert HIDDEN not in str(first.get("got", "")), (graded["user"], name, first)


def test_memory_and_disk_are_limited_for_the_sandbox_as_a_whole(graded):
    held = graded["three_processes_hold_300_MiB_of_256"]
    assert held["error"] is None, held
    assert held["tests"][0].get("got", "").strip() != "ok"
    if graded["user"] == "user":       # no cgroup to write: the harness's watch is what stopped it
        assert (held["limits"], held["tests"][0]["status"]) == ("rlimits", MEMORY_STATUS), held
    assert "No space left" in graded["files_past_the_disk_limit"]["tests"][0]["stderr"]
    memfd = graded["memfds_past_the_memory_limit"]["tests"][0]
    assert "Function not implemented" in memfd["stderr"], memfd


def test_a_program_that_closes_its_pipes_is_stopped_at_its_own_time_limit(graded):
    """Not waited for until the grader gives up on the whole sandbox: the test times out, the
    task reports (before: no report, 'sandbox did not finish within the total time limit')."""
    r = graded["closed_pipes_then_sleep"]
    assert r["error"] is None and r["tests"][0]["status"] == "timeout", r


def test_nothing_survives_in_the_kernel_keyring(graded):
    assert graded["keyring_write"]["tests"][0]["got"].strip() == "refused"
    assert graded["keyring_read"]["tests"][0]["got"].strip() == "none"


@pytest.mark.parametrize("name", list(LEGITIMATE))
def test_programs_behave_as_under_plain_python(graded, name):
    r = graded[name]
    assert r["error"] is None and r["tests"][0]["passed"], (graded["user"], name, r)


LEAVES_CHILDREN_HOLDING_MEMORY = r"""
import os, time
r, w = os.pipe()
for _ in range(2):
    if os.fork() == 0:
        block = bytearray(80 << 20)
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
os.close(w)
assert os.read(r, 1) + os.read(r, 1) == b"xx"
print(int(input()) * 2)
"""


@pytest.mark.parametrize("user", USERS)
def test_children_left_holding_memory_are_stopped_and_the_verdict_stands(user):
    """A correct program that leaves two children holding 80 MiB each: the harness kills them and
    judges the answer. A killed process takes milliseconds to free that memory; the harness used
    to give up after 50 rounds of microseconds and report "the program's processes could not all
    be stopped" for about half of such runs (6 runs: all passed only ~2% of the time)."""
    if why_not(user):
        pytest.skip(why_not(user))
    # A test time limit well past the program's own (a fraction of a second): under the suite's
    # other workers one run in six once took over CFG's 2 s, and the limit is not what is tested.
    roomy = {**CFG, "code_test_timeout_s": 10.0, "code_total_timeout_s": 60.0}
    results = run_as(user, [{"program": LEAVES_CHILDREN_HOLDING_MEMORY, "inputs": ["21"], "outputs": ["42"]}] * 6, roomy)
    assert [r["tests"][0]["status"] for r in results] == ["passed"] * 6, results


def test_without_isolation_the_work_directory_is_removed_whatever_it_holds(tmp_path):
    """The rlimits-only sandbox's work directory is on the host: a 1,200-deep tree (shutil.rmtree
    raised RecursionError and left it) and a directory made unreadable are both removed."""
    if why_not("root"):
        pytest.skip(why_not("root"))
    cfg = RewardConfig(code_test_timeout_s=5.0, code_total_timeout_s=10.0, sandbox="rlimits", allow_unisolated=True)
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tandem-sbx-")}
    program = ("import os\nos.mkdir('locked')\nopen('locked/f', 'w').write('x')\nos.chmod('locked', 0)\n"
               + LEGITIMATE["deep_directories"][0])
    r = Sandbox(cfg).run(program, [""], ["42"])
    assert r.error is None and r.tests[0]["passed"], r
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tandem-sbx-")} == before


def test_task_cgroups_left_by_a_dead_grader_are_removed():
    """A grader killed mid-task leaves its task's cgroup; the next grader process removes it."""
    from tandem.reward import sandbox_cgroup

    if why_not("root") or not sandbox_cgroup.available():
        pytest.skip(why_not("root") or "no writable cgroup here")
    _, parent = sandbox_cgroup.layout()
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 100000   # no such process
    stale = parent / f"tandem-sbx-{dead}-0"
    stale.mkdir()
    assert sandbox_cgroup.remove_stale() == 1
    assert not stale.exists()
