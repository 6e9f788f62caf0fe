"""The `local` backend: every role as a supervised subprocess on this machine.

Roles are started exactly as on a cluster (`tandem <role> --exp DIR`) and find each other
through `<exp>/services/`, so a run here exercises the same code paths. Each child gets its own
session (process group) so shutdown can take down grandchildren too. With a CPU placement
(launcher.placement) each child is pinned to its pool's CPUs — by the supervisor right after the
start, and again by `tandem` itself before any thread exists ($TANDEM_CPUS) — and its thread
budget is the size of that set, so generation and training do not slow each other. With
gen.backend: sglang on a GPU machine, each server and the trainer get the plan's GPUs. The trainer
runs as several ranks when its world is larger than 1 (`local_ranks.py`): each its own child,
with its own CPU set, the torch.distributed variables SLURM's tasks get, and the run's view of
them as one trainer.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.services.protocol import STOP_GRACE_S, ExpDir, MetricsWriter, free_port, write_json_atomic
from tandem.services.protocol.transport import IPC_DIR_ENV

from ..config import ExperimentConfig
from ..launcher_watch import SERVICES_STOP_AFTER_S, launcher_env, roles_of
from ..placement import CPUS_ENV, CpuPlacement, format_ranges
from ..plan import cpu_placement_for, local_trainer_world
from ..role_cpu import RoleCpuMeter
from ..roles import Role, gpu_layout, visible_gpus
from .base import Announcement, Backend, Ended, LaunchError, announce_trainer_stop
from .local_ranks import TrainerRanks, rank_env
from .role_forks import FORKED_KINDS, ForkedRole, RoleForks, gpu_build_of_torch

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0


@dataclass
class Child:
    role: Role
    proc: subprocess.Popen | ForkedRole
    env: dict[str, str]
    started: float = field(default_factory=time.time)
    restarts: int = 0
    # Taken just before the start: readiness is a write after it (None: no ready file).
    announcement: Announcement | None = None


class LocalSupervisor:
    """Starts roles, waits for them to be ready, restarts those that may be restarted."""

    def __init__(self, exp: ExpDir, placement: CpuPlacement | None = None, fork_roles: bool = False):
        self.exp = exp
        self.placement = placement
        self.children: dict[str, Child] = {}
        self.hurried = False   # Ctrl-C during a stop: what is left is killed without a grace
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
                # The launcher is a light service too; close() gives it its CPUs back.
                self._own_cpus = os.sched_getaffinity(0)
                os.sched_setaffinity(0, placement.services)
        # The preloading server (role_forks.py), started by prepare() or the first role it forks.
        self.fork_roles = fork_roles and not gpu_build_of_torch()
        self.forks: RoleForks | None = None
        # The roles' Unix sockets (services/protocol/transport.py, IPC_DIR_ENV) and the trainer
        # ranks' rendezvous file: a directory of this launch only its user may enter, so on one
        # machine no other user can connect to a role at all.
        self.private_dir = tempfile.mkdtemp(prefix="tandem-run-")

    def forked(self, role: Role) -> bool:
        """Whether `role` is to start as a fork of the preloading server (else fresh)."""
        return self.fork_roles and role.kind in FORKED_KINDS and role.command[0] == sys.executable

    def fork_server(self) -> RoleForks:
        """The preloading server, started on first use. Its imports take seconds: on the run's
        CPUs, not only the light services' to which the launcher moved (the roles forked from it
        are pinned to their own)."""
        if self.forks is None:
            self.forks = RoleForks(self.exp.logs / "role-forks.console", self._env(1), cpus=self._own_cpus)
        return self.forks

    def _env(self, threads: int) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TANDEM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               IPC_DIR_ENV: self.private_dir}
        env.pop(CPUS_ENV, None)
        return env

    def start(self, role: Role, env: dict[str, str] | None = None, wait: bool = True) -> Child:
        """Start `role` (with extra variables `env`); with `wait`, return once it is ready."""
        announcement = Announcement(self.exp.service_file(role.ready_file)) if role.ready_file else None
        threads, cpus = role.threads, None
        if self.placement is not None:
            cpus = self.placement.cpus_for(role.name)
            threads = self.placement.threads_for(role.name)
        full_env = {**self._env(threads), **launcher_env(role.kind), **(env or {})}
        if cpus:
            full_env[CPUS_ENV] = format_ranges(cpus)
        proc = None
        if self.forked(role):
            proc = self.fork_server().spawn(role.command[1:], full_env, self.console(role.name))
        if proc is None:
            with open(self.console(role.name), "ab") as console:
                proc = subprocess.Popen(role.command, stdout=console, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        if cpus:
            # At once, while the child is still a single thread starting Python (children that
            # are not `tandem` get their set this way only); `tandem` pins itself again.
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except ProcessLookupError:
                pass
        previous = self.children.get(role.name)
        child = Child(role, proc, env or {}, restarts=previous.restarts if previous else 0,
                      announcement=announcement)
        self.children[role.name] = child
        log.info("started %s (pid %d%s)", role.name, proc.pid,
                 f", CPUs {format_ranges(cpus)}, {threads} thread(s)" if cpus else "")
        if wait:
            self.wait_ready(child)
        return child

    def wait_ready(self, child: Child, wave: Sequence[Child] = ()) -> None:
        """Until `child` announces itself (at once for a role without a ready file). A role of the
        same `wave` that fails meanwhile ends the wait at once: a trainer rank that dies leaves
        rank 0 waiting in the rendezvous, and nothing else would say why."""
        announcement = child.announcement
        if announcement is None:
            return
        timeout_s = child.role.ready_timeout_s or START_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while not announcement.fresh():
            for other in (child, *wave):
                code = other.proc.poll()
                if code is not None and (other is child or code != 0):
                    when = "before it was ready" if other is child else f"while {child.role.name} was starting"
                    raise LaunchError(f"{other.role.name} exited with status {code} {when}; see "
                                      f"{self.console(other.role.name)}\n{self.tail(other.role.name)}")
            if time.monotonic() >= deadline:
                raise LaunchError(f"{child.role.name} not ready after {timeout_s:.0f}s (no new "
                                  f"{announcement.path}); see {self.console(child.role.name)}")
            time.sleep(0.1)

    def console(self, name: str):
        return self.exp.logs / f"{name}.console"

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.console(name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])

    def poll(self) -> list[Ended]:
        """Children that exited since the last poll (restarting the restartable ones)."""
        out = []
        self.cpu.sample({name: c.proc.pid for name, c in self.children.items()})
        for name, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            role = child.role
            why = f"{name} exited with status {code}; console {self.console(name)}:\n{self.tail(name)}"
            if role.restart and code != 0 and child.restarts < role.max_restarts:
                log.warning("%s exited with status %s; restarting (%d/%d)", name, code, child.restarts + 1,
                            role.max_restarts)
                child.restarts += 1
                self.start(role, child.env)
                out.append(Ended(role, ok=False, why=why, restarted=True))
            else:
                del self.children[name]
                out.append(Ended(role, ok=code == 0, why=why))
        return out

    def stop(self, names: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM each role's process group, then SIGKILL what is left: nothing stays behind."""
        targets = [self.children[n] for n in (names if names is not None else list(self.children))
                   if n in self.children]
        self.cpu.sample({c.role.name: c.proc.pid for c in targets}, force=True)
        for child in targets:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + (0.0 if self.hurried else grace_s)
        for child in targets:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.role.name, grace_s)
            except KeyboardInterrupt:   # Ctrl-C again: no more waiting, for any role
                log.warning("interrupted again: killing %s and the rest now", child.role.name)
                self.hurried, deadline = True, 0.0
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
            self.children.pop(child.role.name, None)
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
        if self.forks is not None:
            self.forks.close()
            self.forks, self.fork_roles = None, False
        shutil.rmtree(self.private_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen | ForkedRole, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalBackend(Backend):
    """The run's roles as children of this process."""

    def __init__(self, cfg: ExperimentConfig, exp: ExpDir, supervisor: LocalSupervisor | None = None):
        self.exp = exp
        self.sup = supervisor or LocalSupervisor(exp, cpu_placement_for(cfg), cfg.launcher.fork_roles)
        local = cfg.launcher.backend == "local"
        self.gpu_plan = gpu_layout(cfg) if local else None
        # The plan numbers GPUs 0..N-1; the launcher's own CUDA_VISIBLE_DEVICES says which they are.
        self.gpus = visible_gpus() if self.gpu_plan is not None else []
        # Trainer ranks (the plan's on GPUs, launcher.cpus.trainer_ranks on the CPU miniature).
        self.trainer_world = local_trainer_world(cfg) if local else 1
        self.trainer_stop_s = cfg.launcher.trainer_stop_s
        self.trainers: dict[str, TrainerRanks] = {}   # rank's name -> its trainer

    def pick_port(self) -> int:
        # Fixed at launch: a restarted server binds the same address, which the controller knows.
        return free_port()

    def check_can_start(self) -> None:
        """Roles of an earlier launch still running here (its launcher was killed a moment ago,
        and they are stopping by themselves: launcher_watch.py) are waited for, as long as their
        launcher would have given them; a second set of roles beside them is never started."""
        left = roles_of(self.exp.root)
        if not left:
            return
        wait_s = SERVICES_STOP_AFTER_S + max(STOP_GRACE_S, self.trainer_stop_s) + 5.0
        print(f"waiting up to {wait_s:.0f}s for {len(left)} role(s) of an earlier launch of {self.exp.root} "
              f"to stop (they stop by themselves once their launcher is gone) ...", flush=True)
        deadline = time.monotonic() + wait_s
        while (left := roles_of(self.exp.root)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            raise LaunchError(f"roles of an earlier launch of {self.exp.root} are still running after "
                              f"{wait_s:.0f}s; stop them first (kill PID):\n  " + "\n  ".join(left))

    def _env(self, role: Role) -> dict[str, str]:
        """On a local GPU machine each server gets its TP group's GPUs and each trainer rank the
        training GPUs (it picks its own with LOCAL_RANK, as under torchrun and on SLURM). A
        trainer rank stopping because this launcher is gone gets the trainer's grace."""
        env = launcher_env(role.kind, self.trainer_stop_s) if role.kind == "trainer" else {}
        if self.gpu_plan is None or role.kind not in ("gen", "trainer"):
            return env
        if role.kind == "trainer":
            return {**env, "CUDA_VISIBLE_DEVICES": self._devices(self.gpu_plan.trainer_devices(role.index))}
        return {"CUDA_VISIBLE_DEVICES": self._devices(self.gpu_plan.cuda_visible_devices(role.kind, role.index))}

    def _devices(self, planned: str) -> str:
        """The plan's GPU numbers as this machine's (identity when the launcher saw none)."""
        if not self.gpus:
            return planned
        return ",".join(self.gpus[int(i)] for i in planned.split(","))

    def _processes(self, role: Role) -> list[tuple[Role, dict[str, str]]]:
        """What starting `role` starts: itself, or the trainer's ranks with their rendezvous."""
        if role.kind != "trainer":
            return [(role, self._env(role))]
        trainer = TrainerRanks(role, self.trainer_world)
        # A rendezvous file of this start (a restarted trainer must not meet a dead one's keys).
        store = os.path.join(self.sup.private_dir, f"trainer-store-{time.time_ns()}")
        out = []
        for rank in trainer.ranks:
            self.trainers[rank.name] = trainer
            out.append((rank, {**self._env(rank), **rank_env(rank.index, self.trainer_world, store)}))
        return out

    def prepare(self, roles: list[Role]) -> None:
        if any(self.sup.forked(role) for role in roles):
            self.sup.fork_server()

    def start(self, roles: list[Role]) -> None:
        """All of the wave at once, then wait for each (they load their models in parallel)."""
        children = [self.sup.start(proc, env, wait=False) for role in roles for proc, env in self._processes(role)]
        for child in children:
            self.sup.wait_ready(child, children)

    def ended(self) -> list[Ended]:
        out = []
        for end in self.sup.poll():
            trainer = self.trainers.get(end.role.name)
            heard = trainer.heard(end) if trainer is not None else end
            if heard is not None:
                out.append(heard)
        return out

    def run_to_end(self, role: Role) -> Ended:
        child = self.sup.start(role, self._env(role))
        code = child.proc.wait()
        self.sup.children.pop(role.name, None)
        return Ended(role, ok=code == 0, why=f"{role.name} exited with status {code}:\n{self.sup.tail(role.name)}")

    def stop(self, roles: list[str] | None = None) -> None:
        if roles is not None:   # the trainer's name stands for all its ranks
            roles = [n for name in roles for n in (self.trainers[name].names if name in self.trainers
                                                    and self.trainers[name].role.name == name else [name])]
        self.sup.stop(roles)

    def describe(self) -> str:
        ranks = f"; the trainer as {self.trainer_world} ranks" if self.trainer_world > 1 else ""
        return f"subprocesses of this launcher{ranks}"

    def close(self, status: str) -> None:
        # Rollout workers first, while the services they report to still run: their in-flight
        # groups end and are reported, so nothing waits on a stopped service until SIGKILL.
        self.sup.stop([name for name, c in self.sup.children.items() if c.role.kind == "rollout"])
        # Then the trainer, the services still up: it finishes its step and writes its last
        # checkpoint. Only a whole trainer gets the long grace: ranks whose peer is gone can
        # wait in a collective forever.
        ranks = [n for n, c in self.sup.children.items() if c.role.kind == "trainer" and c.proc.poll() is None]
        if ranks and len(ranks) == self.trainer_world:
            announce_trainer_stop(self.trainer_stop_s)
            self.sup.stop(ranks, grace_s=self.trainer_stop_s)
        self.sup.stop()
