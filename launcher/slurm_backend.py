"""The `slurm` backend: every role as a SLURM job submitted through submitit.

`run_slurm` turns the roles of `launcher.run.role_specs` and the allocation plan into jobs —
controller, reward service and rollout workers as CPU jobs, one GPU job per generation server,
the trainer as ONE multi-node job with one task per GPU — submits them in dependency order,
waits for each to announce itself in `<exp>/services/`, and then watches them. Nothing in the
roles knows it runs under SLURM: they find each other through the shared experiment directory,
exactly as with the local backend.

A run must never leave half an experiment burning GPU hours: when a role's job fails, is
cancelled, times out or loses its node, the launcher says which and why (SLURM's state, the
exit code, the tail of the role's console) and cancels every other job — or, with
`launcher.slurm.on_failure: resubmit`, resubmits a restartable role (not the trainer, which
continues with `--resume`) a bounded number of times. Job ids go to
`<exp>/services/slurm-jobs.json` as they are submitted, so `tandem status` and `tandem cancel`
work from any shell, and whatever way the launcher ends, its `finally` cancels what is left.

Each task runs a `RoleCommand` (launcher/slurm_task.py), which fails the task when its role
fails, so SLURM's job state tells the watcher the truth.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.protocol import ExpDir

from .config import ExperimentConfig
from .local import LaunchError, tandem_argv
from .slurm_jobs import (
    JobState,
    cancel_flag,
    query_states,
    read_record,
    recorded_job_ids,
    scancel,
    write_record,
)
from .slurm_requests import JobRequest, SlurmPolicy, job_requests, policy_of, time_minutes
from .slurm_task import RoleCommand, console_name, tail

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
        self.record = {"experiment": cfg.experiment.name, "submitit_folder": str(self.folder),
                       "started_at": time.time(), "status": "starting", "roles": {}}
        exp.services.mkdir(parents=True, exist_ok=True)
        cancel_flag(exp).unlink(missing_ok=True)   # a cancel of an earlier launch (before --resume)

    def _executor(self, req: JobRequest):
        import submitit

        s = self.cfg.launcher.slurm
        ex = submitit.SlurmExecutor(folder=self.folder)
        partition = (self.policy.cpu_partition or s.partition) if req.gpus_per_node == 0 else s.partition
        params = dict(job_name=f"tandem-{self.cfg.experiment.name}-{req.name}", time=time_minutes(s.time),
                      nodes=req.nodes, ntasks_per_node=req.tasks_per_node, cpus_per_task=req.threads,
                      partition=partition, account=s.account, qos=s.qos, constraint=s.constraint,
                      exclusive=True if req.exclusive else None,
                      gpus_per_node=req.gpus_per_node or None, stderr_to_stdout=True,
                      setup=list(self.policy.setup) or None,
                      # One dead trainer rank must end the job, not leave the others in a collective.
                      srun_args=["--kill-on-bad-exit=1"] if req.distributed else None,
                      additional_parameters=dict(s.extra) or None)
        ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
        return ex

    def submit(self, req: JobRequest) -> Submitted:
        import submitit

        if req.ready_file:
            self.exp.service_file(req.ready_file).unlink(missing_ok=True)
        fn = RoleCommand(req.name, req.command, str(self.exp.root), req.threads, req.distributed)
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
            "job_id": sub.job_id, "kind": req.kind, "nodes": req.nodes, "tasks": req.nodes * req.tasks_per_node,
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

    def why(self, name: str, state: JobState) -> str:
        rank = 0 if self.jobs[name].req.nodes * self.jobs[name].req.tasks_per_node > 1 else None
        console = self.exp.logs / console_name(name, rank)
        wrapper = self.folder / f"{state.job_id}_0_log.out"
        return (f"{name} (job {state.job_id}) {state.describe()}; submitit log {wrapper}; "
                f"console {console}:\n{tail(console)}")

    def wait_ready(self, names: list[str]) -> None:
        """Until every role named announces itself; a job that ends first is reported with its
        reason (polling all of them, so a server dying while another loads is seen at once)."""
        paths = {n: self.exp.service_file(self.jobs[n].req.ready_file) for n in names}
        deadline = time.monotonic() + self.policy.ready_timeout_s
        next_poll = 0.0
        while waiting := [n for n, p in paths.items() if not p.exists()]:
            if time.monotonic() >= next_poll:
                states = self.states(waiting)
                for n, state in states.items():
                    if not state.active and not paths[n].exists():
                        raise LaunchError(f"{self.why(n, state)}\nended before it was ready")
                if time.monotonic() >= deadline:
                    late = ", ".join(f"{n} (job {states[n].job_id}, {states[n].describe()})" for n in waiting)
                    raise LaunchError(f"not ready after {self.policy.ready_timeout_s:.0f}s: {late}; raise "
                                      f"launcher.slurm.ready_timeout_s if the queue is slow")
                next_poll = time.monotonic() + min(self.policy.poll_s, 5.0)
            time.sleep(0.2)

    def teardown(self, status: str) -> list[str]:
        """Cancel every job still queued or running; returns ids SLURM still lists afterwards."""
        ids = [s.job_id for s in self.jobs.values()]
        left = scancel(ids) if ids else []
        self.save(status)
        if left:
            log.error("jobs still listed by squeue after scancel: %s", " ".join(left))
        return left


def _joined(on_ready, exp: ExpDir, req: JobRequest) -> None:
    """Run the readiness hook; its failure is a launch failure (reported, then torn down)."""
    if on_ready is None:
        return
    try:
        on_ready(exp, req)
    except Exception as e:  # a timeout, a RemoteError from the controller, ...
        raise LaunchError(f"{req.name} is up but could not join the run: {type(e).__name__}: {e}") from e


def _register_gen(exp: ExpDir, req: JobRequest) -> None:
    """A generation server joins the controller's registry once it is up (as locally)."""
    if req.kind == "gen":
        from .run import register_server
        register_server(exp, int(req.name.split("-")[1]))


def run_slurm(cfg: ExperimentConfig, exp: ExpDir, resume: bool, requests: list[JobRequest] | None = None,
              on_ready: Callable[[ExpDir, JobRequest], None] | None = _register_gen,
              policy: SlurmPolicy | None = None) -> int:
    """Submit every role as a SLURM job, watch them until the trainer finishes, stop the rest.

    `requests` defaults to `job_requests(cfg, exp, resume)` (the real roles, sized by the plan);
    tests pass stand-in commands (python one-liners that announce themselves and sleep) with
    `on_ready=None`, because the real role commands need the whole system; `policy` defaults
    to `policy_of(cfg)`. Returns 0 when the
    trainer completes, 1 when a role fails or the run is cancelled, 2 for a plan/config error,
    130 on Ctrl-C; in every case no job of the experiment is left running.
    """
    from .plan import PlanError
    from .progress import Progress, summarize

    t0 = time.time()
    try:
        policy = policy or policy_of(cfg)
        requests = requests if requests is not None else job_requests(cfg, exp, resume)
    except (PlanError, LaunchError) as e:
        print(f"tandem run: {e}", file=sys.stderr, flush=True)
        return 2
    leftover = _live_jobs_of_earlier_launch(exp)
    if leftover:
        print(f"tandem run: jobs of an earlier launch of {exp.root} are still queued or running "
              f"({' '.join(leftover)}); stop them first with: tandem cancel --exp {exp.root}",
              file=sys.stderr, flush=True)
        return 2
    run = SlurmRun(cfg, exp, policy)
    progress = Progress(exp, cfg.trainer.total_steps)
    previous_term = _sigterm_interrupts()
    evals: dict[str, dict | None] = {}
    eval_size = getattr(cfg.rollout, "eval_size", 0)
    status = "failed"
    try:
        for wave in _waves(requests):
            if wave[0].kind == "trainer" and eval_size > 0 and not resume:
                print("evaluating the starting policy ...", flush=True)
                evals["before"] = _evaluate(run, "before")
            for req in wave:
                run.submit(req)
            run.wait_ready([r.name for r in wave if r.ready_file])
            for req in wave:
                if req.ready_file:
                    _joined(on_ready, exp, req)
        run.save("running")
        print(f"run {cfg.experiment.name}: {len(requests)} SLURM jobs up in {time.time() - t0:.0f}s "
              f"(jobs: {' '.join(f'{n}={s.job_id}' for n, s in run.jobs.items())}); logs in {exp.logs}",
              flush=True)
        _watch(run, on_ready, progress)
        for name in [n for n in run.jobs if n.startswith("rollout")]:
            scancel([run.jobs.pop(name).job_id])
        if eval_size > 0:
            print("evaluating the trained policy ...", flush=True)
            evals["after"] = _evaluate(run, "after")
        summary = summarize(exp, evals, wall_s=time.time() - t0)
        print(json.dumps({k: summary.get(k) for k in ("steps", "eval", "wall_s")}, indent=1), flush=True)
        status = "finished"
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; cancelling every job ...", flush=True)
        status = "interrupted"
        return 130
    except LaunchError as e:
        print(f"tandem run: {e}\ncancelling every other job of the experiment ...", file=sys.stderr, flush=True)
        status = "cancelled" if run.cancel_requested() else "failed"
        return 1
    finally:
        run.teardown(status)
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _live_jobs_of_earlier_launch(exp: ExpDir) -> list[str]:
    """Jobs a previous launcher (killed before its teardown) left behind; a --resume must not
    start a second copy of every role next to them."""
    try:
        ids = recorded_job_ids(read_record(exp))
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return sorted(j for j, s in query_states(ids).items() if s.active and s.state != "UNKNOWN")


def _sigterm_interrupts():
    """SIGTERM (scancel of a launcher started by slurm/train.sbatch, a shutdown) becomes a
    KeyboardInterrupt, so the teardown in run_slurm's `finally` runs; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second one must not cut the teardown short
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _waves(requests: list[JobRequest]) -> list[list[JobRequest]]:
    """Consecutive roles of one family (gen-0, gen-1, ...) are submitted together and then
    awaited, so 48 servers queue and load their model in parallel, not one after another;
    families still start in order (controller, reward, servers, trainer, workers)."""
    waves: list[list[JobRequest]] = []
    for req in requests:
        family = req.name.rsplit("-", 1)[0]
        if waves and waves[-1][0].name.rsplit("-", 1)[0] == family:
            waves[-1].append(req)
        else:
            waves.append([req])
    return waves


def _watch(run: SlurmRun, on_ready, progress) -> None:
    """Until the trainer's job completes; a role that ends otherwise is resubmitted or fatal."""
    trainer = next(n for n, s in run.jobs.items() if s.req.kind == "trainer")
    while True:
        time.sleep(run.policy.poll_s)
        if run.cancel_requested():
            raise LaunchError("the experiment was cancelled (tandem cancel)")
        for name, state in run.states().items():
            if state.active:
                continue
            sub = run.jobs[name]
            if name == trainer:
                if state.state == "COMPLETED":
                    return
                raise LaunchError(f"the trainer's job failed: {run.why(name, state)}\n"
                                  f"continue from its last checkpoint with: tandem run <file> --resume")
            if state.state == "COMPLETED":
                print(f"{name} (job {state.job_id}) finished", flush=True)
                del run.jobs[name]
                continue
            if run.policy.on_failure == "resubmit" and sub.req.restart and sub.resubmits < run.policy.max_resubmits:
                print(f"{run.why(name, state)}\nresubmitting {name} "
                      f"({sub.resubmits + 1}/{run.policy.max_resubmits})", flush=True)
                run.submit(sub.req)
                if sub.req.ready_file:
                    run.wait_ready([name])
                    _joined(on_ready, run.exp, sub.req)
                continue
            raise LaunchError(f"role {run.why(name, state)}")
        progress.update()


def _evaluate(run: SlurmRun, tag: str) -> dict | None:
    """Greedy accuracy of the servers' current policy, as a CPU job (`tandem eval`)."""
    out = run.exp.root / f"eval-{tag}.json"
    req = JobRequest(f"eval-{tag}", tandem_argv("eval", "--exp", str(run.exp.root), "--out", str(out)),
                     kind="eval")
    run.submit(req)
    while (state := run.states([req.name])[req.name]).active:
        time.sleep(min(run.policy.poll_s, 5.0))
    if state.state != "COMPLETED" or not out.exists():
        log.error("evaluation '%s' failed: %s", tag, run.why(req.name, state))
        del run.jobs[req.name]
        return None
    del run.jobs[req.name]
    return json.loads(out.read_text())

