"""A role stops when its launcher is gone (launcher/launcher_watch.py).

Real processes and signals throughout: a stand-in launcher (the real `LocalSupervisor` in a
process of its own, or a plain `sleep` whose pid a role is given) is SIGKILLed, and the roles
it started must end by themselves — cleanly on SIGTERM, or SIGKILLed with their process group
after the grace. tests/integration/test_faults.py does the same to a whole `tandem run`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.launcher.launcher_watch import GRACE_ENV, PID_ENV, STOP_AFTER_ENV

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init, which may never reap it here)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _role(tmp_path: Path, body: str, launcher_pid: int, stop_after: float, grace: float,
          pidfd: bool = True) -> tuple[subprocess.Popen, Path]:
    """A Python process that arms the real watch (as `tandem`'s main does) and then runs `body`."""
    console = tmp_path / "role.console"
    code = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        if not {pidfd}:
            del os.pidfd_open          # a system without pidfds: the watch polls
        from tandem.launcher.launcher_watch import watch_launcher_from_env
        """) + textwrap.dedent(body)
    env = {**os.environ, PID_ENV: str(launcher_pid), STOP_AFTER_ENV: str(stop_after), GRACE_ENV: str(grace),
           "PYTHONUNBUFFERED": "1"}
    with open(console, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return proc, console


def _wait_for(console: Path, text: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (seen := console.read_text()):
        assert time.monotonic() < deadline, f"no {text!r} in:\n{seen}"
        time.sleep(0.05)
    return seen


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_role_gets_sigterm_the_given_time_after_its_launcher_dies(tmp_path, pidfd):
    launcher = subprocess.Popen(["sleep", "600"])
    role, console = _role(tmp_path, """
        def stop(signum, frame):
            print("SIGTERM at", time.monotonic(), flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        watch_launcher_from_env()
        print("ready", flush=True)
        time.sleep(600)
        """, launcher.pid, stop_after=1.0, grace=60, pidfd=pidfd)
    _wait_for(console, "ready")
    killed_at = time.monotonic()
    launcher.kill()
    launcher.wait()
    assert role.wait(30) == 0            # its own clean shutdown, long before the grace
    out = console.read_text()
    assert f"the launcher (pid {launcher.pid}) is gone" in out, out
    term_at = float(out.split("SIGTERM at ")[1].split()[0])
    assert term_at - killed_at >= 1.0, out   # after stop_after, not at once


def test_a_role_that_ignores_sigterm_is_killed_with_its_process_group_after_the_grace(tmp_path):
    launcher = subprocess.Popen(["sleep", "600"])
    role, console = _role(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "600"])    # in the role's process group
        watch_launcher_from_env()
        print("child", child.pid, flush=True)
        time.sleep(600)
        """, launcher.pid, stop_after=0, grace=1.0)
    child = int(_wait_for(console, "child ").split("child ")[1].split()[0])
    launcher.kill()
    launcher.wait()
    assert role.wait(30) == -signal.SIGKILL
    assert _wait_gone(child, 10), f"the role's child {child} outlived it"
    assert "SIGKILL" in console.read_text()


def test_a_launcher_gone_before_the_watch_starts_stops_the_role_at_once(tmp_path):
    launcher = subprocess.Popen(["true"])
    launcher.wait()                       # exited and reaped: no such process any more
    role, console = _role(tmp_path, """
        watch_launcher_from_env()
        time.sleep(600)
        """, launcher.pid, stop_after=0, grace=60)
    assert role.wait(30) == -signal.SIGTERM, console.read_text()


LAUNCHER = """
import sys, time
from pathlib import Path
from tandem.launcher.backends.local import LocalSupervisor
from tandem.launcher.roles import Role, tandem_argv
from tandem.services.protocol import ExpDir
exp = ExpDir(Path(sys.argv[1]))
sup = LocalSupervisor(exp, None, fork_roles=sys.argv[2] == "forked")
child = sup.start(Role("controller-0", tandem_argv("controller", "--exp", str(exp.root)), kind="controller",
                       ready_file="controller", ready_timeout_s=120))
print("role", child.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
def test_a_real_role_started_by_the_supervisor_stops_cleanly_when_the_launcher_is_sigkilled(tmp_path, forked,
                                                                                           capsys):
    """The real supervisor starts a real controller (fresh, or forked from the preloading server,
    whose parent is not the launcher's); the launcher is SIGKILLed; the controller receives
    SIGTERM after the services' wait and shuts down on its own. A new launch of the experiment
    started at once (`--resume` right after the crash) waits for it rather than starting a second
    controller beside it."""
    from tandem.launcher.backends.local import LocalBackend
    from tandem.launcher.config import load_config, save_resolved
    from tandem.launcher.launcher_watch import SERVICES_STOP_AFTER_S
    from tandem.services.protocol import ExpDir, generate_keys
    exp = ExpDir(tmp_path / "exp")
    cfg = load_config("configs/math-tiny.yaml", [f"experiment.exp_dir={exp.root}"])
    save_resolved(cfg, exp.root)
    generate_keys(exp.keys)
    console = tmp_path / "launcher.console"
    with open(console, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(exp.root), "forked" if forked else "fresh"],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pid = None
    try:
        pid = int(_wait_for(console, "role ", 150).split("role ")[1].split()[0])
        env = Path(f"/proc/{pid}/environ").read_text().split("\0")
        assert f"{PID_ENV}={launcher.pid}" in env and f"{STOP_AFTER_ENV}={SERVICES_STOP_AFTER_S:g}" in env
        launcher.kill()
        launcher.wait()
        backend = LocalBackend(cfg, exp)
        try:
            backend.check_can_start()            # the next launch, at once
        finally:
            backend.sup.close()
        assert not _running(pid), f"controller {pid} still running when the next launch went ahead"
        assert f"waiting up to {SERVICES_STOP_AFTER_S + cfg.launcher.trainer_stop_s + 5:.0f}s for 1 role(s) of an " \
               f"earlier launch of {exp.root}" in capsys.readouterr().out
    finally:
        for group in (launcher.pid, pid):
            if group is not None and _running(group):
                os.killpg(group, signal.SIGKILL)
    log = (exp.logs / "controller-0.log").read_text()
    assert f"the launcher (pid {launcher.pid}) is gone" in log and "received SIGTERM; shutting down" in log, log
