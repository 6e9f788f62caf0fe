"""Hostile programs sent through the real reward service: each is a failure, the service stays
up, nothing they did is left on the host, and no process of theirs survives."""
from __future__ import annotations

import os
import shutil
import socket
import threading

import pytest
from grader_users import GRADER_UID, USERS, user_prefix, why_not
from reward_service_helpers import (
    REWARD_OVERRIDES,
    SECRET,
    scan_own_memory,
    start_service,
    stop_service,
    wait_no_sandbox_processes,
)

from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import Sandbox
from tandem.services.protocol import GradeItem, GradeRequest

VAR_TMP_FILE = f"/var/tmp/tandem-pwned-{os.getpid()}"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or Sandbox(RewardConfig()).isolation != "bwrap",
                                reason="bubblewrap not installed or not permitted here")


MEMORY_SECRET = "EXPECTED-SECRET-" + "481516"     # the program searches for the prefix only
MEMORY_SCAN = scan_own_memory("EXPECTED-SECRET-[0-9]{6}")


def hostile_programs(host_file: str, port: int, secret_file: str) -> dict[str, tuple[str, dict]]:
    """name -> (program, tests); every test would pass if the hostile action succeeded."""
    ok = {"inputs": [""], "outputs": ["ok"]}
    call = {"fn_name": "f", "inputs": [[1]], "outputs": [1]}
    return {
        "infinite_loop": ("while True:\n    pass", ok),
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", ok),
        "memory_bomb": ("a = []\nwhile True:\n    a.append(bytearray(50 * 2**20))\nprint('ok')", ok),
        "gigabytes_of_output": ("import sys\nchunk = 'x' * 65536\nwhile True:\n    sys.stdout.write(chunk)", ok),
        "write_outside_tmp": (f"open({host_file!r}, 'w').write('pwned')\nprint('ok')", ok),
        "write_etc": ("open('/etc/tandem-pwned', 'w').write('x')\nprint('ok')", ok),
        "write_var_tmp": (f"open({VAR_TMP_FILE!r}, 'w').write('x')\nprint('ok')", ok),
        # A root-only file (0600) outside /tmp, like the experiment's secret key on shared storage.
        "read_root_only_file": (f"print(open({secret_file!r}).read())", {"inputs": [""], "outputs": [SECRET]}),
        "kill_parent": ("import os\nos.kill(os.getppid(), 9)\nprint('ok')", ok),
        "kill_parent_call": ("import os\nos.kill(os.getppid(), 9)\ndef f(x):\n    return x", call),
        "read_secret": ("import os\nprint(os.environ.get('TANDEM_TEST_SECRET', 'none'))",
                        {"inputs": [""], "outputs": [SECRET]}),
        "read_secret_proc": ("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                             {"inputs": [""], "outputs": [SECRET]}),
        "open_socket": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('ok')", ok),
        "sys_exit_before_checks": ("import sys\nsys.exit(0)\ndef f(x):\n    return x", call),
        "os_exit_before_checks": ("import os\nos._exit(0)\ndef f(x):\n    return x", call),
        "fake_report": ("import sys, os\nos.write(1, b'{\"i\": 0, \"value\": 1}\\n')\nos._exit(0)", call),
        # The judge's state: its memory, environment and command line (the harness is pid 1 of
        # the sandbox's namespace or the parent), and its expected outputs in them.
        "read_harness_memory": ("import os\nfor pid in (1, os.getppid()):\n    try:\n"
                                "        print(open(f'/proc/{pid}/mem', 'rb').read(10))\n    except OSError:\n        pass\n"
                                "print(input())", {"inputs": ["x"], "outputs": ["expected-7781"]}),
        "outputs_in_harness_cmdline": ("import os\ndata = b''\nfor pid in os.listdir('/proc'):\n    try:\n"
                                       "        data += open(f'/proc/{pid}/cmdline', 'rb').read()\n    except OSError:\n        pass\n"
                                       "print('expected-7781' if b'expected-7781' in data else 'no')",
                                       {"inputs": [""], "outputs": ["expected-7781"]}),
        # Comparisons: a value whose __eq__ lies, a patched builtin or gc walk in the program's
        # process, a wrong answer for a type the judge might coerce.
        "lying_eq": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                     "def f(x):\n    return Yes()", call),
        "patch_builtins": ("import builtins\nbuiltins.isinstance = lambda *a: True\n"
                           "import gc\nfor o in gc.get_objects():\n    pass\ndef f(x):\n    return 2", call),
        "bool_for_int": ("def f(x):\n    return True", call),
        "str_for_int": ("def f(x):\n    return '1'", call),
        "str_for_float": ("def f(x):\n    return '0.5'", {"fn_name": "f", "inputs": [[1]], "outputs": [0.5]}),
        "bool_for_float": ("def f(x):\n    return True", {"fn_name": "f", "inputs": [[1]], "outputs": [1.0]}),
        "near_int_call": ("def f(x):\n    return 123456789.0001", {"fn_name": "f", "inputs": [[1]], "outputs": [123456789]}),
        # stdio: an integer is compared exactly, not within a relative tolerance
        "near_int_stdio": ("print(123456790)", {"inputs": [""], "outputs": ["123456789"]}),
        "float_for_big_int": ("print('1e18')", {"inputs": [""], "outputs": ["1000000000000000001"]}),
        # An integer is its text (zero-padded output is asked for), a decimal is written in ASCII
        # (float() reads any Unicode digit, `1_000.5`, `infinity`).
        "no_leading_zeros": ("print(7)", {"inputs": [""], "outputs": ["007"]}),
        "leading_zeros": ("print('007')", {"inputs": [""], "outputs": ["7"]}),
        "plus_sign": ("print('+7')", {"inputs": [""], "outputs": ["7"]}),
        "fullwidth_decimal": ("print('\uff17.\uff15')", {"inputs": [""], "outputs": ["7.5"]}),
        "arabic_indic_decimal": ("print('\u0667.\u0665')", {"inputs": [""], "outputs": ["7.5"]}),
        "underscored_decimal": ("print('7_0.5')", {"inputs": [""], "outputs": ["70.5"]}),
        "infinity_spelled_out": ("print('infinity')", {"inputs": [""], "outputs": ["inf"]}),
        # Its own memory, inherited from the harness: expected outputs it held when it forked
        # this test (made dumpable again, so /proc/self/mem opens).
        "scan_own_memory_stdio": (MEMORY_SCAN + "print(found)", {"inputs": ["", ""], "outputs": [MEMORY_SECRET] * 2}),
        "scan_own_memory_call": (MEMORY_SCAN + "def f(x):\n    return found",
                                 {"fn_name": "f", "inputs": [[1], [2]], "outputs": [MEMORY_SECRET] * 2}),
        # A file written by an early test to change what a later test sees.
        "files_across_tests": ("import os\nif os.path.exists('seen'):\n    print('ok')\nelse:\n"
                               "    open('seen', 'w').write('1')\n    print('first')",
                               {"inputs": ["", ""], "outputs": ["ok", "ok"]}),
    }


@pytest.fixture(scope="module", params=USERS)
def reward_service(request, tmp_path_factory):
    """The service run by root, and by an ordinary user (as on clusters: see grader_users)."""
    if why_not(request.param):
        pytest.skip(why_not(request.param))
    root = tmp_path_factory.mktemp("reward") / "exp"
    if request.param == "user":
        svc = start_service(root, REWARD_OVERRIDES, user_prefix(readable=(str(root),)), owner=GRADER_UID)
    else:
        svc = start_service(root, REWARD_OVERRIDES)
    yield svc
    stop_service(svc)


def test_hostile_programs_fail_and_leave_nothing(reward_service, tmp_path):
    host_file = tmp_path / "pwned"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    connections = []

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept())
            except TimeoutError:
                continue
            except OSError:
                return

    stop = threading.Event()
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    secret_file = f"/var/tmp/tandem-secret-{os.getpid()}"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, SECRET.encode())
    os.close(fd)
    programs = hostile_programs(str(host_file), listener.getsockname()[1], secret_file)
    items = [GradeItem(task="code", response=f"```python\n{src}\n```", tests=tests)
             for src, tests in programs.values()]
    client = reward_service.client(timeout_s=120)
    try:
        reply = client.request(GradeRequest(items=items, deadline_s=110))
    finally:
        client.close()
        stop.set()
        acceptor.join(5)
        listener.close()
        os.unlink(secret_file)
    verdicts = dict(zip(programs, reply.verdicts, strict=True))
    for name, v in verdicts.items():
        assert not v.correct, (name, v.details)
        assert v.reward == -5.0, name
        assert v.details["isolation"] == "bwrap", name
        assert "error" not in v.details, (name, v.details)  # graded as a failure, not a grader error
    for name in ("scan_own_memory_stdio", "scan_own_memory_call"):   # not one test may pass
        assert verdicts[name].details["passed"] == 0, (name, verdicts[name].details)
    assert "timeout" in verdicts["infinite_loop"].details["reason"]
    assert "output limit" in verdicts["gigabytes_of_output"].details["reason"]
    assert "no result" in verdicts["os_exit_before_checks"].details["reason"]
    assert not host_file.exists() and not os.path.exists(VAR_TMP_FILE)
    if "read_root_only_file" in verdicts:
        reason = verdicts["read_root_only_file"].details["tests"][0]["stderr"]
        # Not even there: the sandbox's root holds nothing of the host but the interpreter.
        assert "No such file" in reason, reason
    assert not connections
    # The service is alive and its pool whole; nothing the programs started is still running.
    state = reward_service.status()
    assert len(state["workers"]) == 2 and state["restarts"] == 0
    c = reward_service.client()
    try:
        ok = c.request(GradeRequest(items=[GradeItem(task="math", response=r"\boxed{2}", answer="2")]))
    finally:
        c.close()
    assert ok.verdicts[0].correct
    assert wait_no_sandbox_processes() == []
