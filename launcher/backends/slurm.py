"""The `slurm` backend: every role as a SLURM job submitted through submitit.

`SlurmBackend` turns the roles of `launcher.roles` and the allocation plan into jobs —
controller, reward service and rollout workers as CPU jobs, one GPU job per generation server,
the trainer as ONE multi-node job with one task per GPU — submits each wave the lifecycle
starts, waits for its roles to announce themselves in `<exp>/services/`, and then watches them. Nothing in the
roles knows it runs under SLURM: they find each other through the shared experiment directory,
exactly as with the local backend.

A run must never leave half an experiment burning GPU hours: when a role's job fails, is
cancelled, times out or loses its node, the launcher says which and why (SLURM's state, the
exit code, the tail of the role's console) and cancels every other job — or, with
`launcher.slurm.on_failure: resubmit`, resubmits a restartable role (not the trainer, which
continues with `--resume`, automatically where launcher/continuation.py says so) a bounded
number of times. Jobs are submitted `--no-requeue`: SLURM's own requeue after a lost node or a
preemption would rerun a role behind the launcher's back (a trainer without `--resume`, a
server nobody registers); the launcher decides instead. Job ids go to
`<exp>/services/slurm-jobs.json` as they are submitted, so `tandem status` and `tandem cancel`
work from any shell, and whatever way the launcher ends, its `finally` cancels what is left.

Each task runs a `RoleCommand` (launcher/slurm_task.py), which fails the task when its role
fails, so SLURM's job state tells the watcher the truth.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field, replace

from tandem.services.protocol import STOP_GRACE_S, ExpDir

from ..config import ExperimentConfig
from ..launcher_watch import HEARTBEAT_FILE, Heartbeat
from ..roles import Role
from ..slurm_jobs import (
    JobState,
    cancel_flag,
    query_states,
    read_record,
    recorded_job_ids,
    scancel,
    write_record,
)
from ..slurm_task import RoleCommand, console_name, tail, time_limit_note
from .base import Announcement, Backend, Ended, LaunchError, RoleFailed, announce_trainer_stop
from .slurm_requests import (
    JobRequest,
    SlurmPolicy,
    adopt_plan,
    excluding,
    job_requests,
    policy_of,
    time_minutes,
)

log = logging.getLogger(__name__)


@dataclass
class Submitted:
    req: JobRequest
    job_id: str
    resubmits: int = 0
    previous: list[str] = field(default_factory=list)


class SlurmRun:
    """Submits role jobs, keeps the record on disk, waits for readiness, tears down."""

    def __init__(self, cfg: ExperimentConfig, exp: ExpDir, policy: SlurmPolicy):
        self.cfg, self.exp, self.policy = cfg, exp, policy
        self.folder = exp.logs / "slurm"
        self.jobs: dict[str, Submitted] = {}
        self.announcements: dict[str, Announcement] = {}
        self.record = {"experiment": cfg.experiment.name, "submitit_folder": str(self.folder),
                       "started_at": time.time(), "status": "starting", "roles": {},
                       "launcher_job": os.environ.get("SLURM_JOB_ID")}   # slurm/train.sbatch's, if any
        exp.services.mkdir(parents=True, exist_ok=True)
        cancel_flag(exp).unlink(missing_ok=True)   # a cancel of an earlier launch (before --resume)
        # The lease its jobs watch (launcher_watch.py): renewed until the teardown has ended.
        lease_s = cfg.launcher.slurm.launcher_lease_s
        self.heartbeat = Heartbeat(exp.services / HEARTBEAT_FILE, lease_s).start() if lease_s > 0 else None

    def _executor(self, req: JobRequest):
        import submitit

        s = self.cfg.launcher.slurm
        ex = submitit.SlurmExecutor(folder=self.folder)
        partition = (self.policy.cpu_partition or s.partition) if req.gpus_per_node == 0 else s.partition
        params = dict(job_name=f"tandem-{self.cfg.experiment.name}-{req.name}", time=time_minutes(s.time),
                      nodes=req.nodes, ntasks_per_node=req.tasks_per_node, cpus_per_task=req.role.threads,
                      partition=partition, account=s.account, qos=s.qos, constraint=s.constraint,
                      exclusive=True if req.exclusive else None,
                      gpus_per_node=req.gpus_per_node or None, stderr_to_stdout=True,
                      setup=list(self.policy.setup) or None,
                      # One dead trainer rank must end the job, not leave the others in a collective.
                      srun_args=["--kill-on-bad-exit=1"] if req.distributed else None,
                      additional_parameters=no_requeue(s.extra, req.exclude))
        ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
        return ex

    def submit(self, req: JobRequest) -> Submitted:
        import submitit

        role = req.role
        if role.ready_file:
            self.announcements[role.name] = Announcement(self.exp.service_file(role.ready_file))
        stop_s = self.cfg.launcher.trainer_stop_s if role.kind == "trainer" else STOP_GRACE_S
        fn = RoleCommand(role.name, role.command, str(self.exp.root), role.threads, req.distributed,
                         lease_s=self.cfg.launcher.slurm.launcher_lease_s, grace_s=stop_s)
        try:
            with submitit.helpers.clean_env():   # a launcher inside a SLURM job must not leak its job
                job = self._executor(req).submit(fn)
        except (subprocess.CalledProcessError, submitit.core.utils.FailedJobError, OSError) as e:
            raise LaunchError(f"sbatch refused {req.name}: {str(e).strip()}") from None
        old = self.jobs.get(req.name)
        sub = Submitted(req, str(job.job_id), old.resubmits + 1 if old else 0,
                        old.previous + [old.job_id] if old else [])
        self.jobs[req.name] = sub
        self.record["roles"][req.name] = {
            "job_id": sub.job_id, "kind": role.kind, "nodes": req.nodes, "tasks": req.nodes * req.tasks_per_node,
            "gpus_per_node": req.gpus_per_node, "submitted_at": time.time(), "resubmits": sub.resubmits,
            "previous": sub.previous, "console": str(self.exp.logs / console_name(req.name, None))}
        self.save()
        log.info("submitted %s as job %s", req.name, sub.job_id)
        return sub

    def save(self, status: str | None = None) -> None:
        if status:
            self.record["status"] = status
        write_record(self.exp, self.record)

    def cancel_requested(self) -> bool:
        return cancel_flag(self.exp).exists()

    def states(self, names: list[str] | None = None) -> dict[str, JobState]:
        names = names or list(self.jobs)
        by_id = query_states([self.jobs[n].job_id for n in names])
        out = {n: by_id[self.jobs[n].job_id] for n in names}
        for n, state in out.items():
            if state.state == "GONE":   # no accounting: submitit's result pickles tell how it ended
                out[n] = self._outcome_from_results(self.jobs[n])
        return out

    def _outcome_from_results(self, sub: Submitted) -> JobState:
        from submitit.core.utils import JobPaths, pickle_load

        tasks = sub.req.nodes * sub.req.tasks_per_node
        for t in range(tasks):
            path = JobPaths(self.folder, sub.job_id, t).result_pickle
            try:
                outcome, _ = pickle_load(path)
            except (OSError, EOFError):
                return JobState(sub.job_id, "FAILED", f"ended without a result (task {t}); no accounting")
            if outcome != "success":
                return JobState(sub.job_id, "FAILED", f"task {t} raised; no accounting")
        return JobState(sub.job_id, "COMPLETED")

    def cause(self, name: str, state: JobState) -> str:
        """SLURM's state word for how the job ended; TIMEOUT also for a job whose role the
        time-limit warning stopped (its wrapper's note, slurm_task.py), which SLURM calls FAILED."""
        sub = self.jobs[name]
        if state.state == "FAILED" and any(time_limit_note(self.folder, state.job_id, t).exists()
                                           for t in range(sub.req.nodes * sub.req.tasks_per_node)):
            return "TIMEOUT"
        return state.state

    def end_of(self, name: str, state: JobState, ok: bool = False, restarted: bool = False) -> Ended:
        return Ended(self.jobs[name].req.role, ok=ok, why=self.why(name, state), restarted=restarted,
                     cause=self.cause(name, state), job_id=state.job_id)

    def why(self, name: str, state: JobState) -> str:
        rank = 0 if self.jobs[name].req.nodes * self.jobs[name].req.tasks_per_node > 1 else None
        console = self.exp.logs / console_name(name, rank)
        wrapper = self.folder / f"{state.job_id}_0_log.out"
        how = state.describe()
        if self.cause(name, state) == "TIMEOUT" and state.state != "TIMEOUT":
            how = f"stopped at its time limit by SLURM's warning (sacct: {how})"
        return (f"{name} (job {state.job_id}) {how}; submitit log {wrapper}; "
                f"console {console}:\n{tail(console)}")

    def wait_ready(self, names: list[str]) -> None:
        """Until every role named announces itself; a job that ends first is reported with its
        reason (polling all of them, so a server dying while another loads is seen at once)."""
        ready = {n: self.announcements[n] for n in names}
        deadline = time.monotonic() + self.policy.ready_timeout_s
        next_poll = 0.0
        while waiting := [n for n, a in ready.items() if not a.fresh()]:
            if time.monotonic() >= next_poll:
                states = self.states(waiting)
                for n, state in states.items():
                    if not state.active and not ready[n].fresh():
                        end = self.end_of(n, state)
                        raise RoleFailed(f"{end.why}\nended before it was ready", end)
                if time.monotonic() >= deadline:
                    late = ", ".join(f"{n} (job {states[n].job_id}, {states[n].describe()})" for n in waiting)
                    raise LaunchError(f"not ready after {self.policy.ready_timeout_s:.0f}s: {late}; raise "
                                      f"launcher.slurm.ready_timeout_s if the queue is slow")
                next_poll = time.monotonic() + min(self.policy.poll_s, 5.0)
            time.sleep(0.2)

    def teardown(self, status: str, trainer_stop_s: float = 0.0) -> list[str]:
        """Cancel every job still queued or running; returns ids SLURM still lists afterwards.
        With `trainer_stop_s`: the rollout workers' jobs first, then the trainer's tasks get
        SIGTERM (through their wrapper, slurm_task.py) and that long to finish the step and write
        the last checkpoint, the services still up; a plain cancel leaves it the cluster's
        KillWait (30 s by default). A second Ctrl-C cancels everything at once."""
        trainer = [s.job_id for s in self.jobs.values() if s.req.role.kind == "trainer"]
        if trainer_stop_s > 0 and any(st.state == "RUNNING" for st in query_states(trainer).values()):
            scancel([s.job_id for s in self.jobs.values() if s.req.role.kind == "rollout"])
            announce_trainer_stop(trainer_stop_s)
            try:
                scancel(trainer, wait_s=trainer_stop_s, signal="TERM")
            except KeyboardInterrupt:
                log.warning("interrupted again: cancelling every job now")
        ids = [s.job_id for s in self.jobs.values()]
        left = scancel(ids) if ids else []
        self.save(status)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if left:
            log.error("jobs still listed by squeue after scancel: %s", " ".join(left))
        return left


class SlurmBackend(Backend):
    """The run's roles as SLURM jobs, submitted through submitit.

    `requests` replaces the plan's sizing of named roles (tests give stand-in roles their own
    job shapes); `policy` defaults to the experiment's `launcher.slurm` section."""

    def __init__(self, cfg: ExperimentConfig, exp: ExpDir, policy: SlurmPolicy | None = None,
                 requests: list[JobRequest] | None = None):
        self.cfg, self.exp = cfg, exp
        self.policy = policy or policy_of(cfg)
        self.poll_s = self.policy.poll_s
        # Servers bind an interface other nodes reach; RoleCommand puts the node's name in for {node}.
        self.gen_host = self.policy.bind_host
        self.sized = {r.name: r for r in requests or []}
        self.plan = None
        self.run = SlurmRun(cfg, exp, self.policy)

    def pick_port(self) -> int:
        return 0   # the server picks a free port on whatever node it lands

    def check_can_start(self) -> None:
        self.plan = adopt_plan(self.cfg, self.exp)   # before the role list: it fixes the server count
        leftover = live_jobs_of_earlier_launch(self.exp)
        if leftover and requeued_launcher(self.exp):
            print(f"this launcher's job {os.environ['SLURM_JOB_ID']} was requeued; the jobs its earlier run left "
                  f"({' '.join(leftover)}) have no launcher any more: cancelling them", flush=True)
            leftover = scancel(leftover)
        if leftover:
            lease = self.cfg.launcher.slurm.launcher_lease_s
            raise LaunchError(f"jobs of an earlier launch of {self.exp.root} are still queued or running "
                              f"({' '.join(leftover)}); stop them first with: tandem cancel --exp {self.exp.root}"
                              + (f" (running ones stop by themselves within launcher.slurm.launcher_lease_s = "
                                 f"{lease:g} s of their launcher's end)" if lease > 0 else ""))

    def _requests(self, roles: list[Role]) -> list[JobRequest]:
        unsized = [r for r in roles if r.name not in self.sized]
        sized = {q.name: q for q in job_requests(self.cfg, unsized, self.plan)} if unsized else {}
        return [self.sized.get(r.name) or sized[r.name] for r in roles]

    def start(self, roles: list[Role], exclude: str = "") -> None:
        """`exclude`: nodes the jobs must not run on (`tandem scale --add N --exclude NODES`)."""
        for req in self._requests(roles):
            self.run.submit(replace(req, exclude=excluding(req.exclude, exclude)))
        self.run.wait_ready([r.name for r in roles if r.ready_file])

    def ended(self) -> list[Ended]:
        if not self.run.jobs:
            return []
        out = []
        for name, state in self.run.states().items():
            if state.active:
                continue
            sub = self.run.jobs[name]
            if state.state == "COMPLETED":
                out.append(self.run.end_of(name, state, ok=True))
                del self.run.jobs[name]
            elif (self.policy.on_failure == "resubmit" and sub.req.role.restart
                  and sub.resubmits < self.policy.max_resubmits):
                end = self.run.end_of(name, state, restarted=True)
                req = sub.req
                if state.state == "NODE_FAIL" and state.nodes:   # not again on the node that failed
                    req = replace(req, exclude=excluding(req.exclude, state.nodes))
                log.warning("%s; resubmitting (%d/%d)%s", end.why, sub.resubmits + 1, self.policy.max_resubmits,
                            f", not on {req.exclude}" if req.exclude else "")
                self.run.submit(req)
                if sub.req.role.ready_file:
                    self.run.wait_ready([name])
                out.append(end)
            else:
                out.append(self.run.end_of(name, state))
                del self.run.jobs[name]
        return out

    def run_to_end(self, role: Role) -> Ended:
        self.run.submit(JobRequest(role))
        while (state := self.run.states([role.name])[role.name]).active:
            time.sleep(min(self.poll_s, 5.0))
        end = self.run.end_of(role.name, state, ok=state.state == "COMPLETED")
        del self.run.jobs[role.name]
        return end

    def stop(self, roles: list[str] | None = None) -> None:
        names = roles if roles is not None else list(self.run.jobs)
        ids = [self.run.jobs.pop(n).job_id for n in names if n in self.run.jobs]
        if ids:
            scancel(ids)

    def running(self) -> None:
        self.run.save("running")

    def cancelled(self) -> bool:
        return self.run.cancel_requested()

    def describe(self) -> str:
        return "SLURM jobs " + " ".join(f"{n}={s.job_id}" for n, s in self.run.jobs.items())

    def close(self, status: str) -> None:
        if not self.run.record["roles"]:
            return   # nothing submitted (refused before the start): the record on disk stays as it is
        if status == "failed" and self.cancelled():
            status = "cancelled"
        self.run.teardown(status, self.cfg.launcher.trainer_stop_s)


def no_requeue(extra: dict, exclude: str = "") -> dict:
    """The sbatch options beyond submitit's own: `--no-requeue` (module docstring) unless the
    experiment's `launcher.slurm.extra` says otherwise, then `extra` as given, its `exclude`
    joined with the job's own (`exclude`: nodes a scaled-in server or a resubmission avoids)."""
    said = {k.replace("_", "-") for k in extra}
    out = ({} if said & {"requeue", "no-requeue"} else {"no_requeue": True}) | dict(extra)
    if exclude:
        out["exclude"] = excluding(str(out.get("exclude") or ""), exclude)
    return out


def requeued_launcher(exp: ExpDir, env=os.environ) -> bool:
    """Whether this launcher is a requeued run of the job whose earlier run launched the jobs on
    record (slurm/train.sbatch after its node was lost): that launcher is gone for sure — a job
    runs once at a time — so its jobs may be cancelled rather than waited for."""
    job_id = env.get("SLURM_JOB_ID")
    try:
        launched_by = read_record(exp).get("launcher_job")
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return bool(job_id) and int(env.get("SLURM_RESTART_COUNT") or 0) > 0 and launched_by == job_id


def live_jobs_of_earlier_launch(exp: ExpDir) -> list[str]:
    """Jobs a previous launcher (killed before its teardown) left behind; a --resume must not
    start a second copy of every role next to them."""
    try:
        ids = recorded_job_ids(read_record(exp))
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return sorted(j for j, s in query_states(ids).items() if s.active and s.state != "UNKNOWN")
