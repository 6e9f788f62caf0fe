"""The `local` backend: every role as a supervised subprocess on this machine.

Roles are started exactly as on a cluster (`tandem <role> --exp DIR`) and find each other
through `<exp>/services/`, so a run here exercises the same code paths. Each child gets its own
session (process group) so shutdown can take down grandchildren too, and a thread budget so
roles do not fight over the cores.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.protocol import ExpDir

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A role failed to start or died in a way the run cannot survive."""


@dataclass
class RoleSpec:
    name: str          # e.g. "gen-0"; its log is logs/<name>.console
    argv: list[str]    # after `tandem`
    threads: int = 1
    ready_file: str | None = None   # services/<file>.json that signals readiness
    restart: bool = False           # restart on a crash (servers that rejoin)
    max_restarts: int = 3
    on_ready: Callable[[], None] | None = None  # e.g. register a generation server with the controller


@dataclass
class Child:
    spec: RoleSpec
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    restarts: int = 0


def tandem_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


class LocalSupervisor:
    """Starts roles, waits for them to be ready, restarts those that may be restarted."""

    def __init__(self, exp: ExpDir):
        self.exp = exp
        self.children: dict[str, Child] = {}
        exp.logs.mkdir(parents=True, exist_ok=True)

    def start(self, spec: RoleSpec, timeout_s: float = 180.0) -> Child:
        if spec.ready_file:
            self.exp.service_file(spec.ready_file).unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads),
               "TANDEM_THREADS": str(spec.threads), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        console = open(self.exp.logs / f"{spec.name}.console", "ab")
        proc = subprocess.Popen(tandem_argv(*spec.argv), stdout=console, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        console.close()
        child = Child(spec, proc, restarts=self.children[spec.name].restarts if spec.name in self.children else 0)
        self.children[spec.name] = child
        if spec.ready_file:
            self._wait_ready(child, timeout_s)
        if spec.on_ready:
            spec.on_ready()
        log.info("started %s (pid %d)", spec.name, proc.pid)
        return child

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        path = self.exp.service_file(child.spec.ready_file)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                return
            if child.proc.poll() is not None:
                raise LaunchError(f"{child.spec.name} exited with status {child.proc.returncode} "
                                  f"before it was ready; see {self.exp.logs / (child.spec.name + '.console')}"
                                  f"\n{self.tail(child.spec.name)}")
            time.sleep(0.1)
        raise LaunchError(f"{child.spec.name} not ready after {timeout_s:.0f}s "
                          f"(no {path}); see {self.exp.logs / (child.spec.name + '.console')}")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.exp.logs / f"{name}.console"
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])

    def poll(self) -> list[Child]:
        """Children that exited since the last poll (restarting the restartable ones)."""
        exited = []
        for name, child in list(self.children.items()):
            if child.proc.poll() is None:
                continue
            exited.append(child)
            spec = child.spec
            if spec.restart and child.proc.returncode != 0 and child.restarts < spec.max_restarts:
                log.warning("%s exited with status %s; restarting (%d/%d)", name, child.proc.returncode,
                            child.restarts + 1, spec.max_restarts)
                self.children[name].restarts += 1
                self.start(spec)
            else:
                del self.children[name]
        return exited

    def stop(self, names: list[str] | None = None, grace_s: float = 15.0) -> None:
        """SIGTERM each role's process group, then SIGKILL what is left: nothing stays behind."""
        targets = [self.children[n] for n in (names or list(self.children)) if n in self.children]
        for child in targets:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in targets:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.spec.name, grace_s)
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
            self.children.pop(child.spec.name, None)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def console_path(exp: ExpDir, name: str) -> Path:
    return exp.logs / f"{name}.console"
