"""Automatic continuation: a run on SLURM goes on by itself after the cluster ended one of its jobs.

An RL run lasts days; partitions cap jobs at a day or two and preempt them, and nodes die. Each
of those used to end the run until a person typed `tandem run FILE --resume`, so a run stopped
at 3 a.m. lost the night. With `launcher.slurm.auto_resume: N` the launcher does the resume
itself: the same `prepare(..., resume=True)` and `run_experiment(..., resume=True)` a typed
`--resume` runs (every role resubmitted, the trainer from its last checkpoint, a `resumed`
mark in the metrics, the audit's accounting across the boundary), not a path of its own.

Which ends continue (`decide`) is a question of whose doing they were:
- the cluster's — TIMEOUT (the job's limit; also a role the time-limit warning stopped, which
  SLURM records as FAILED: the wrapper's note, slurm_task.py), PREEMPTED, NODE_FAIL, BOOT_FAIL:
  continued, at most N times per launcher, after a back-off that doubles (a preempting job or a
  failing node is often still there a minute later; the queue is the better place to wait);
- the run's own — FAILED (a crash), OUT_OF_MEMORY, and CANCELLED (a person or `tandem cancel`),
  DEADLINE: never. A crash that is deterministic would only repeat, and one that is not is
  still worth a person's look; what to change for OUT_OF_MEMORY is the person's to say.
- the same cluster end twice in a row at the same step (the same role, the same state, no step
  trained in between: a time limit shorter than a step and its checkpoint, a node that dies on
  the same step): stopped, saying so, instead of looping until N runs out.

Each decision is said three ways: a line on the console; a `continued` (or `not_continued`)
record in `<exp>/metrics.jsonl`, which `tandem status` lists and `tandem report` marks on its
timeline; and the job record's status while the back-off runs.

The launcher's own job (slurm/train.sbatch) has a limit too. The script asks SLURM for SIGUSR1
five minutes before it (`--signal=B:USR1@300`); the launcher stops the run as on Ctrl-C (the
trainer checkpoints) and then requeues its job (`requeue_own_job`): SLURM runs the script again
under the same job id, and it launches with `--resume` (SLURM_RESTART_COUNT > 0). The new
launcher takes the experiment's lock, which the old one released by exiting, so the run never
has two. At most `auto_resume` requeues per job.

The local backend does not
continue: on one machine a trainer dies by its code or the machine's memory, neither of which a
second try changes, and a machine that reboots takes the launcher with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.protocol import ExpDir, read_metrics
from tandem.services.protocol.runtime import MetricsWriter

from .backends import Backend, RoleFailed

CONTINUED, NOT_CONTINUED = "continued", "not_continued"   # metrics.jsonl events (role: launcher)
# SLURM states the cluster caused, and what they mean to a reader.
CLUSTER_ENDS = {"TIMEOUT": "reached its time limit", "PREEMPTED": "was preempted",
                "NODE_FAIL": "lost its node", "BOOT_FAIL": "its node failed to boot"}
MAX_BACKOFF_FACTOR = 16
OWN_LIMIT_SIGNAL = signal.SIGUSR1   # slurm/train.sbatch: the launcher's job nears its limit
_own_limit = threading.Event()


@dataclass(frozen=True)
class Failure:
    """How one launch ended: the role whose job ended first, SLURM's word for it, the job, and the
    highest step the run had trained by then."""
    role: str
    cause: str
    step: int
    job_id: str = ""

    def same_as(self, other: Failure | None) -> bool:
        return other is not None and (self.role, self.cause, self.step) == (other.role, other.cause, other.step)

    def describe(self) -> str:
        what = CLUSTER_ENDS.get(self.cause, f"ended {self.cause or 'with an error'}")
        job = f" (job {self.job_id})" if self.job_id else ""
        return f"{self.role}{job} {what}" + (f" ({self.cause})" if self.cause in CLUSTER_ENDS else "") + \
            f" at step {self.step}"


@dataclass(frozen=True)
class Verdict:
    go: bool
    why: str
    wait_s: float = 0.0
    attempt: int = 0          # 1 for the first continuation of this launcher


def backoff_s(attempt: int, base_s: float) -> float:
    """Seconds before continuation `attempt` (1, 2, ...): base, 2x, 4x, ... at most 16x base."""
    return base_s * min(2 ** max(attempt - 1, 0), MAX_BACKOFF_FACTOR)


def decide(failure: Failure | None, history: list[Failure], budget: int, base_s: float) -> Verdict:
    """Whether a launch that ended with `failure` is continued, after the continuations in
    `history` (this launcher's, oldest first), with at most `budget` of them."""
    if failure is None:
        return Verdict(False, "the run did not end by a role's job ending (a launch error, a cancel): "
                              "nothing for the cluster to blame")
    if failure.cause not in CLUSTER_ENDS:
        return Verdict(False, f"{failure.describe()}: not the cluster's doing (a crash, memory or a cancel "
                              f"would end the same way again), so it is not continued by itself")
    if history and failure.same_as(history[-1]):
        return Verdict(False, f"{failure.describe()} again, as the launch before it did: it failed the same way "
                              f"twice in a row at the same step, and continuing would loop")
    if len(history) >= budget:
        return Verdict(False, f"{failure.describe()}; it was already continued {len(history)} times "
                              f"(launcher.slurm.auto_resume = {budget})")
    attempt = len(history) + 1
    return Verdict(True, f"{failure.describe()}", backoff_s(attempt, base_s), attempt)


def failure_of(backend: Backend, exp: ExpDir) -> Failure | None:
    """How the launch on `backend` ended, or None when no role's end ended it."""
    err = backend.failure
    if not isinstance(err, RoleFailed):
        return None
    return Failure(err.end.role.name, err.end.cause, last_step(exp), err.end.job_id)


def last_step(exp: ExpDir) -> int:
    """The highest step the run's trainer has recorded, in any launch."""
    return max((r["step"] for r in read_metrics(exp, "trainer", "step") if r.get("step") is not None), default=0)


def record(exp: ExpDir, failure: Failure | None, verdict: Verdict, budget: int) -> dict:
    """The decision as a `continued` / `not_continued` record in `<exp>/metrics.jsonl`."""
    fields = {"event": CONTINUED if verdict.go else NOT_CONTINUED, "why": verdict.why, "budget": budget}
    if failure is not None:
        fields.update(failed_role=failure.role, cause=failure.cause, step=failure.step, job_id=failure.job_id)
    if verdict.go:
        fields.update(attempt=verdict.attempt, wait_s=verdict.wait_s)
    writer = MetricsWriter(exp, "launcher")
    writer.log(**fields)
    writer.close()
    return fields


def continuations(exp: ExpDir) -> list[dict]:
    """The run's `continued` and `not_continued` records, oldest first (status, report)."""
    return [r for r in read_metrics(exp, "launcher") if r.get("event") in (CONTINUED, NOT_CONTINUED)]


Relaunch = Callable[[], tuple[int, Backend, ExpDir]]


def keep_going(code: int, backend: Backend, exp: ExpDir, budget: int, base_s: float, relaunch: Relaunch,
               sleep: Callable[[float], None] = time.sleep) -> int:
    """After a launch that returned `code` on `backend`: continue the run (`relaunch`: the
    `--resume` launch, returning its code, backend and directory) while `decide` says so; the
    exit code of the last launch."""
    history: list[Failure] = []
    while code == 1 and budget > 0:
        failure = failure_of(backend, exp)
        verdict = decide(failure, history, budget, base_s)
        if verdict.go and _cancelled(exp):
            verdict = Verdict(False, "the experiment was cancelled (tandem cancel)")
        record(exp, failure, verdict, budget)
        if not verdict.go:
            print(f"tandem run: not continuing the run by itself: {verdict.why}", file=sys.stderr, flush=True)
            return code
        print(f"tandem run: {verdict.why}: continuing the run from its last checkpoint in {verdict.wait_s:g} s "
              f"(automatic continuation {verdict.attempt} of {budget}, launcher.slurm.auto_resume; "
              f"`tandem cancel --exp {exp.root}` stops it)", flush=True)
        history.append(failure)
        _set_status(exp, f"continuing {verdict.attempt}/{budget} at {time.strftime('%H:%M:%S', time.localtime(time.time() + verdict.wait_s))}")
        if not _wait(exp, verdict.wait_s, sleep):
            print("tandem run: cancelled while waiting to continue", file=sys.stderr, flush=True)
            _set_status(exp, "cancelled")
            return 1
        code, backend, exp = relaunch()
    return code


def _cancelled(exp: ExpDir) -> bool:
    from .slurm_jobs import cancel_flag
    return cancel_flag(exp).exists()


def _wait(exp: ExpDir, seconds: float, sleep: Callable[[float], None]) -> bool:
    """Sleep `seconds` in short naps; False as soon as the experiment is cancelled."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if _cancelled(exp):
            return False
        sleep(min(left, 1.0))
    return not _cancelled(exp)


def _set_status(exp: ExpDir, status: str) -> None:
    """The job record's status (`tandem status` prints it) while no launch runs."""
    from .slurm_jobs import read_record, write_record
    try:
        rec = read_record(exp)
    except (FileNotFoundError, ValueError):
        return
    rec["status"] = status
    write_record(exp, rec)


def note_own_limit() -> None:
    """The launcher's job nears its time limit (the lifecycle's OWN_LIMIT_SIGNAL handler)."""
    _own_limit.set()


def own_limit_reached() -> bool:
    return _own_limit.is_set()


def requeue_own_job(exp: ExpDir, budget: int, env=os.environ, run=subprocess.run,
                    sleep: Callable[[float], None] = time.sleep) -> int:
    """After the run was stopped because the launcher's own job nears its limit: requeue that job
    (slurm/train.sbatch runs again with `--resume`), unless it was requeued `budget` times
    already; recorded and said as any continuation. Returns the exit code for a launcher that
    is still alive afterwards (SLURM kills it when it requeues the job)."""
    job_id = env.get("SLURM_JOB_ID", "")
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    failure = Failure("launcher", "TIMEOUT", last_step(exp), job_id)
    if not job_id:
        verdict = Verdict(False, f"{failure.describe()}, but it runs in no SLURM job to requeue")
    elif restarts >= budget:
        verdict = Verdict(False, f"{failure.describe()}; its job was already requeued {restarts} times "
                                 f"(launcher.slurm.auto_resume = {budget})")
    else:
        verdict = Verdict(True, failure.describe(), 0.0, restarts + 1)
    record(exp, failure, verdict, budget)
    if not verdict.go:
        print(f"tandem run: not continuing the run by itself: {verdict.why}", file=sys.stderr, flush=True)
        return 130
    print(f"tandem run: {verdict.why}: requeueing job {job_id}, which continues the run with --resume when "
          f"SLURM starts it again (requeue {verdict.attempt} of {budget}, launcher.slurm.auto_resume)", flush=True)
    done = run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"tandem run: scontrol requeue {job_id} failed: {(done.stderr or done.stdout).strip()} (is the job "
              f"submitted with --requeue, as slurm/train.sbatch asks?)", file=sys.stderr, flush=True)
        return 1
    _set_status(exp, f"requeued launcher job {job_id}")
    sleep(60)   # SLURM ends this process as it requeues the job; leaving first would race it
    return 0
