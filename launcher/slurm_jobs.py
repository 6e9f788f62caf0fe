"""What SLURM says about an experiment's jobs, and the record that names them.

The launcher writes `<exp>/services/slurm-jobs.json` (role -> job id) as it submits, so any
process on the shared filesystem — `tandem status`, `tandem cancel`, a second terminal, a
relaunched head node — can find and act on the jobs without the launcher that submitted them.
States come from one `sacct` call per poll (it knows finished jobs and why they ended); where
accounting is missing, `squeue` still tells running from gone.
"""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

from tandem.services.protocol import ExpDir, write_json_atomic

RECORD_NAME = "slurm-jobs.json"
# sacct states of a job that is still (or about to be) using its allocation.
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING", "CONFIGURING",
          "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}


class SlurmUnavailable(RuntimeError):
    """squeue did not answer (no SLURM client here, or slurmctld unreachable)."""


@dataclass
class JobState:
    job_id: str
    # The SLURM state word (RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ...);
    # GONE = no longer in squeue and no accounting to say how it ended.
    state: str
    # sacct's "CANCELLED by 0" etc., exit code "1:0", pending reason; for the user to read.
    detail: str = ""
    exit_code: str = ""
    nodes: str = ""
    elapsed: str = ""

    @property
    def active(self) -> bool:
        # UNKNOWN (SLURM did not answer this time) counts as alive: a busy controller's timeout
        # must not tear a healthy run down.
        return self.state in ACTIVE or self.state == "UNKNOWN"

    def describe(self) -> str:
        parts = [self.detail or self.state]
        if self.exit_code and self.exit_code != "0:0":
            parts.append(f"exit code {self.exit_code}")
        if self.nodes and self.nodes not in ("None assigned", "(null)"):
            parts.append(f"on {self.nodes}")
        return ", ".join(parts)


def record_path(exp: ExpDir):
    return exp.services / RECORD_NAME


def cancel_flag(exp: ExpDir):
    """Exists once `tandem cancel` ran: a separate file, so the launcher rewriting the record
    can never lose the request."""
    return exp.services / "slurm-cancel-requested"


def read_record(exp: ExpDir) -> dict:
    path = record_path(exp)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; was {exp.root} launched with "
                                f"launcher.backend=slurm?") from None


def write_record(exp: ExpDir, record: dict) -> None:
    write_json_atomic(record_path(exp), record)


def _run(cmd: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _from_sacct(job_ids: list[str]) -> dict[str, JobState]:
    done = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode,NodeList,Elapsed,Reason",
                 "-j", ",".join(job_ids)])
    if done is None or done.returncode != 0:
        return {}
    states = {}
    for line in done.stdout.splitlines():
        fields = line.split("|")
        if len(fields) < 6:
            continue
        jid, raw, code, nodes, elapsed, reason = fields[:6]
        word = raw.split()[0] if raw else "UNKNOWN"
        detail = raw if raw != word else ""
        if reason and reason != "None" and word == "PENDING":
            detail = f"PENDING ({reason})"
        states[jid] = JobState(jid, word, detail, code, nodes, elapsed)
    return states


def _from_squeue(job_ids: list[str]) -> dict[str, JobState] | None:
    """Queued and running jobs among `job_ids` (squeue forgets finished ones); None = no answer."""
    done = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N|%M"])
    if done is None:
        return None
    if done.returncode != 0:
        # squeue refuses a list made only of ids it has forgotten: none of them is live.
        return {} if "Invalid job id" in done.stderr else None
    states = {}
    for line in done.stdout.splitlines():
        jid, word, reason, nodes, elapsed = (line.split("|") + [""] * 5)[:5]
        detail = f"{word} ({reason})" if word == "PENDING" and reason not in ("", "None") else ""
        states[jid] = JobState(jid, word, detail, "", nodes, elapsed)
    return states


def query_states(job_ids: list[str]) -> dict[str, JobState]:
    """State of each job: squeue for live jobs (sacct lags behind slurmctld by a few seconds),
    sacct for the ended ones (how and why they ended)."""
    job_ids = [str(j) for j in job_ids]
    if not job_ids:
        return {}
    live = _from_squeue(job_ids)
    states = dict(live or {})
    ended = [j for j in job_ids if j not in states]
    if ended:
        states.update({j: s for j, s in _from_sacct(ended).items() if j in ended})
    for j in job_ids:
        if j not in states:
            states[j] = (JobState(j, "UNKNOWN", "neither squeue nor sacct answered") if live is None
                         else JobState(j, "GONE", "not in squeue; no accounting record"))
    return states


def scancel(job_ids: list[str], wait_s: float = 60.0, signal: str | None = None) -> list[str]:
    """Cancel the jobs and wait until squeue no longer lists them; returns those still listed.
    `signal` (e.g. TERM): only send it to the jobs' tasks, which end by themselves (or not)."""
    job_ids = [str(j) for j in job_ids]
    if not job_ids:
        return []
    subprocess.run(["scancel", *([f"--signal={signal}"] if signal else []), *job_ids], capture_output=True, text=True)
    deadline = time.monotonic() + wait_s
    while True:
        live = _from_squeue(job_ids)
        left = sorted(live) if live is not None else job_ids   # no answer: nothing is known gone
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def recorded_job_ids(record: dict) -> list[str]:
    """Every job id the experiment ever submitted (current ones and resubmitted predecessors)."""
    ids = []
    for role in record.get("roles", {}).values():
        ids += [str(j) for j in role.get("previous", [])] + [str(role["job_id"])]
    return ids


def cancel_experiment(exp: ExpDir, wait_s: float = 60.0) -> tuple[list[str], list[str]]:
    """Mark the experiment cancelled (so a watching launcher does not resubmit) and scancel
    every job it holds; returns (cancelled ids, ids squeue still lists after wait_s)."""
    record = read_record(exp)
    cancel_flag(exp).write_text(f"{time.time()}\n")
    ids = recorded_job_ids(record)
    live = _from_squeue(ids)
    if live is None:
        raise SlurmUnavailable(f"squeue did not answer, so the jobs {' '.join(ids)} may still run; "
                               f"is slurmctld reachable from here? (`squeue -j {','.join(ids)}`)")
    targets = sorted(live)
    return targets, scancel(targets, wait_s)
