"""Roles forked from the preloading server (launcher/backends/role_forks.py) look, to themselves and
to the supervisor, like the fresh `python -m ...` processes they replace.

Real: the server process (it imports torch and transformers), its forks, signals, the supervisor.
The role is a stand-in (tests/support/fork_standin.py) that reports what it sees and exits as told,
so each case takes a second; the real roles run forked in every local run of the suite
(tests/integration/e2e; test_local_run.py runs one with `launcher.fork_roles=false`, fresh).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.launcher.backends.local import LocalSupervisor
from tandem.launcher.backends.role_forks import RoleForks, differs_at_import
from tandem.launcher.roles import Role
from tandem.services.protocol import ExpDir

pytestmark = pytest.mark.timeout(180)
SUPPORT = Path(__file__).resolve().parents[2] / "support"


@pytest.fixture(scope="module")
def server_env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def forks(tmp_path_factory, server_env):
    f = RoleForks(tmp_path_factory.mktemp("forks") / "role-forks.console", server_env,
                  also_preload=("xml.dom.minidom", "fork_standin"), cpus={min(os.sched_getaffinity(0))})
    yield f
    f.close()


def _standin(forks, tmp_path, mode, server_env, **env):
    report = tmp_path / f"{mode.replace(':', '-')}.json"
    role = forks.spawn(["-m", "fork_standin", str(report), mode], {**server_env, **env}, tmp_path / "role.console")
    assert role is not None, "the server did not fork (see its console)"
    return role, report


def _report(path: Path, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"no report at {path}")


def test_a_fork_is_its_own_session_with_its_environment_argv_and_console(forks, tmp_path, server_env):
    role, report = _standin(forks, tmp_path, "exit:0", server_env, TANDEM_THREADS="3", RANK="1")
    assert role.wait(60) == 0
    seen = _report(report)
    assert seen["pid"] == role.pid and seen["sid"] == seen["pgid"] == role.pid   # start_new_session
    assert seen["env"]["TANDEM_THREADS"] == "3" and seen["env"]["RANK"] == "1"
    assert seen["argv"][1:] == [str(report), "exit:0"] and seen["argv"][0].endswith("fork_standin.py")
    assert seen["name"] == "__main__" and seen["torch_preloaded"]   # run as -m, in the preloaded interpreter
    assert "xml.dom.minidom" in seen["modules"]                       # also_preload
    # Preloaded too, but run as `python -m` runs a module: only as __main__, and without runpy's
    # "found in sys.modules" warning (which every role's console once began with).
    assert "fork_standin" not in seen["modules"]
    assert os.sched_getaffinity(seen["ppid"]) == {min(os.sched_getaffinity(0))}   # the server's `cpus`
    console = (tmp_path / "role.console").read_text()
    assert "stand-in exit:0" in console and "RuntimeWarning" not in console, console


@pytest.mark.parametrize(("mode", "code"), [("exit:3", 3), ("raise", 1), ("return", 0)])
def test_exit_codes_are_the_roles(forks, tmp_path, server_env, mode, code):
    role, _ = _standin(forks, tmp_path, mode, server_env)
    assert role.wait(60) == code and role.poll() == code
    if mode == "raise":
        assert "RuntimeError: the stand-in failed" in (tmp_path / "role.console").read_text()


def test_atexit_callbacks_run_and_files_left_open_are_flushed(forks, tmp_path, server_env):
    role, report = _standin(forks, tmp_path, "atexit", server_env)
    assert role.wait(60) == 0
    assert Path(f"{report}.atexit").read_text() == "ran"
    assert Path(f"{report}.buffered").read_text() == "flushed at exit"


def test_a_signalled_role_reports_the_signal_and_wait_times_out_before(forks, tmp_path, server_env):
    role, report = _standin(forks, tmp_path, "sleep", server_env)
    _report(report)
    # `ps` and /proc show the role's command line, not the server's
    argv = Path(f"/proc/{role.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert argv == [sys.executable.encode(), b"-m", b"fork_standin", str(report).encode(), b"sleep"]
    environ = Path(f"/proc/{role.pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
    assert dict(kv.decode().split("=", 1) for kv in environ) == _report(report)["env"]
    with pytest.raises(subprocess.TimeoutExpired):
        role.wait(0.3)
    assert role.poll() is None
    role.kill()
    assert role.wait(30) == -signal.SIGKILL   # as Popen says it


def test_a_variable_read_at_import_that_differs_means_a_fresh_start(forks, tmp_path, server_env):
    assert differs_at_import({**server_env, "HF_HOME": "/elsewhere"}, server_env) == ["HF_HOME"]
    # read when services.protocol.collectives is imported (a fork would keep the server's value)
    assert differs_at_import({**server_env, "TANDEM_EMULATE_NCCL": "1"}, server_env) == ["TANDEM_EMULATE_NCCL"]
    assert differs_at_import({**server_env, "OMP_NUM_THREADS": "4", "TANDEM_CPUS": "1"}, server_env) == []
    assert forks.spawn(["-m", "fork_standin", str(tmp_path / "r.json"), "exit:0"],
                       {**server_env, "PYTHONPATH": "/elsewhere"}, tmp_path / "c") is None
    assert forks.spawn([str(SUPPORT / "fork_standin.py"), "r", "exit:0"], server_env, tmp_path / "c") is None


def test_the_supervisor_forks_model_roles_and_starts_the_rest_fresh(tmp_path, server_env, monkeypatch):
    for key, value in server_env.items():
        monkeypatch.setenv(key, value)
    exp = ExpDir(tmp_path / "exp")
    sup = LocalSupervisor(exp, fork_roles=True)
    try:
        reports = {kind: tmp_path / f"{kind}.json" for kind in ("rollout", "controller")}
        roles = {kind: Role(f"{kind}-0", [sys.executable, "-m", "fork_standin", str(path), "exit:0"], kind=kind)
                 for kind, path in reports.items()}
        assert sup.forked(roles["rollout"]) and not sup.forked(roles["controller"])
        assert not sup.forked(Role("rollout-1", ["bash", "-c", "true"], kind="rollout"))   # not python -m
        children = {kind: sup.start(role) for kind, role in roles.items()}
        assert all(c.proc.wait(60) == 0 for c in children.values())
        assert _report(reports["rollout"])["torch_preloaded"]          # forked
        assert not _report(reports["controller"])["torch_preloaded"]   # a light service: fresh
        assert isinstance(children["controller"].proc, subprocess.Popen)
    finally:
        sup.close()
    assert sup.forks is None


def test_when_the_server_dies_its_roles_end_and_later_ones_start_fresh(tmp_path, server_env):
    forks = RoleForks(tmp_path / "role-forks.console", server_env)
    try:
        role, report = _standin(forks, tmp_path, "sleep", server_env)
        _report(report)
        forks._server.kill()
        forks._server.wait()
        os.killpg(role.pid, signal.SIGKILL)
        assert role.wait(30) != 0 and forks.lost   # its exit code went with the server: not 0
        assert forks.spawn(["-m", "fork_standin", str(tmp_path / "late.json"), "exit:0"], server_env,
                           tmp_path / "c") is None
    finally:
        forks.close()
