"""The `local` backend: every role as a supervised subprocess on this machine.

Roles are started exactly as on a cluster (`tandem <role> --exp DIR`) and find each other
through `<exp>/services/`, so a run here exercises the same code paths. Each child gets its own
session (process group) so shutdown can take down grandchildren too. With a CPU placement
(launcher.placement) each child is pinned to its pool's CPUs — by the supervisor right after the
start, and again by `tandem` itself before any thread exists ($TANDEM_CPUS) — and its thread
budget is the size of that set, so generation and training do not slow each other.
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

from services.protocol import ExpDir, MetricsWriter, write_json_atomic

from .placement import CPUS_ENV, CpuPlacement, format_ranges
from .role_cpu import RoleCpuMeter

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
    # Variables set for this role only, e.g. CUDA_VISIBLE_DEVICES from the plan (GPU roles).
    env: dict[str, str] = field(default_factory=dict)
    # Seconds to wait for ready_file (None: start()'s default); an SGLang server loads a big model.
    ready_timeout_s: float | None = None


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

    def __init__(self, exp: ExpDir, placement: CpuPlacement | None = None):
        self.exp = exp
        self.placement = placement
        self.children: dict[str, Child] = {}
        # CPU seconds of every role (its whole process group), for <exp>/role_cpu.json.
        self.cpu = RoleCpuMeter()
        exp.logs.mkdir(parents=True, exist_ok=True)
        self._own_cpus = None
        if placement is not None:
            # Which pools this run shared: the simulator's calibration reads it.
            metrics = MetricsWriter(exp, "launcher")
            metrics.log(**placement.record())
            metrics.close()
            if hasattr(os, "sched_setaffinity"):
                # The launcher is a light service too; stop() gives it its CPUs back.
                self._own_cpus = os.sched_getaffinity(0)
                os.sched_setaffinity(0, placement.services)

    def start(self, spec: RoleSpec, timeout_s: float = 180.0) -> Child:
        if spec.ready_file:
            self.exp.service_file(spec.ready_file).unlink(missing_ok=True)
        threads, cpus = spec.threads, None
        if self.placement is not None:
            cpus = self.placement.cpus_for(spec.name)
            threads = self.placement.threads_for(spec.name)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TANDEM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        env.pop(CPUS_ENV, None)
        env.update(spec.env)
        if cpus:
            env[CPUS_ENV] = format_ranges(cpus)
        console = open(self.exp.logs / f"{spec.name}.console", "ab")
        proc = subprocess.Popen(tandem_argv(*spec.argv), stdout=console, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        console.close()
        if cpus:
            # At once, while the child is still a single thread starting Python (children that
            # are not `tandem` get their set this way only); `tandem` pins itself again.
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except ProcessLookupError:
                pass
        child = Child(spec, proc, restarts=self.children[spec.name].restarts if spec.name in self.children else 0)
        self.children[spec.name] = child
        if spec.ready_file:
            self._wait_ready(child, spec.ready_timeout_s or timeout_s)
        if spec.on_ready:
            spec.on_ready()
        log.info("started %s (pid %d%s)", spec.name, proc.pid,
                 f", CPUs {format_ranges(cpus)}, {threads} thread(s)" if cpus else "")
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
        self.cpu.sample({name: c.proc.pid for name, c in self.children.items()})
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
        self.cpu.sample({c.spec.name: c.proc.pid for c in targets}, force=True)
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
        if names is None:
            self.close()

    def close(self) -> None:
        """After the last role: write <exp>/role_cpu.json, give the launcher its CPUs back."""
        seconds = self.cpu.seconds()
        if seconds:
            write_json_atomic(self.exp.root / "role_cpu.json", {
                "cpu_seconds": seconds,
                "placement": self.placement.record() if self.placement is not None else None})
        if self._own_cpus is not None:
            os.sched_setaffinity(0, self._own_cpus)
            self._own_cpus = None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def console_path(exp: ExpDir, name: str) -> Path:
    return exp.logs / f"{name}.console"
