"""Automatic continuation (`launcher.slurm.auto_resume`, launcher/continuation.py) on the local
SLURM cluster: the launcher resumes a run by itself after the cluster ends one of its jobs, and
stops instead of looping when it fails the same way twice at the same step.

What is real and what stands in, test by test, is in each docstring. Everything SLURM-side is
the cluster's own: sbatch, srun tasks, sacct's states, slurmctld's time limits and node states.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm_launch import job

from tandem.launcher.backends.slurm import SlurmBackend
from tandem.launcher.backends.slurm_requests import SlurmPolicy
from tandem.launcher.config import load_config
from tandem.launcher.continuation import CONTINUED, NOT_CONTINUED, continuations, keep_going
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.run_info import run_info
from tandem.launcher.slurm_jobs import query_states, read_record, recorded_job_ids
from tandem.services.protocol import ExpDir, read_metrics

REPO = Path(__file__).resolve().parents[3]
TANDEM = str(Path(sys.executable).with_name("tandem"))
STANDIN = str(Path(__file__).with_name("standin_role.py"))
pytestmark = pytest.mark.timeout(300)


def _until(what: str, check, timeout_s: float = 90.0, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{log.read_text()[-4000:] if log else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{log.read_text()[-4000:]}" if log else ""))


def _record(exp: ExpDir) -> dict:
    try:
        return read_record(exp)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _running_trainer(exp: ExpDir, not_job: str | None) -> str | None:
    """The trainer's job id once a launch other than the one with `not_job` has every role up."""
    rec = _record(exp)
    job_id = rec.get("roles", {}).get("trainer-0", {}).get("job_id")
    return job_id if rec.get("status") == "running" and job_id and job_id != not_job else None


def _stepped_in_this_launch(exp: ExpDir) -> bool:
    """A trainer step recorded after the last launch boundary (the `resumed` mark of a resume)."""
    records = read_metrics(exp)
    marks = [i for i, r in enumerate(records) if r.get("event") == "resumed"]
    after = records[marks[-1] + 1:] if marks else records
    return any(r.get("role") == "trainer" and r.get("event") == "step" for r in after)


def _node_of(job_id: str) -> str:
    return query_states([job_id])[job_id].nodes


def _squeue_ids() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True).stdout.split())


def test_a_run_continues_by_itself_past_two_time_limits_and_a_lost_node(slurm_cluster, tiny_model_dir, tmp_path):
    """`tandem run` (a real launcher process, the real roles, configs/slurm-local-tiny.yaml with one
    generation server and one trainer rank) trains 8 steps across three automatic continuations
    with nobody acting but the cluster:

    1. and 2. the trainer's job gets SLURM's time-limit warning. Stand-in: the test sends it
       (`scancel --signal=USR2`, the signal and the tasks slurmctld signals at `--signal=USR2@90`)
       once the launch has trained a step, instead of waiting out a limit of whole minutes; the
       rest is real — the job's wrapper turns it into SIGTERM, the trainer checkpoints and exits,
       SLURM records the job FAILED and the wrapper's note makes it TIMEOUT for the launcher.
       (test_the_same_time_limit_twice_at_the_same_step_stops_the_run has slurmctld send it.)
    3. the trainer's node is lost: real — `scontrol update NodeName=... State=DOWN` makes slurmctld
       kill every job on that node and record them NODE_FAIL, as for a node that stops answering
       (the node answers again at once, ReturnToService=2, so the resubmitted jobs find room).

    Each continuation is the `--resume` launch (new jobs for every role, the trainer from its last
    checkpoint); the audit then finds nothing lost or trained twice, and `tandem status`, the
    metrics and the report say each continuation."""
    exp = ExpDir(tmp_path / "exp")
    log = tmp_path / "launcher.out"
    cmd = [TANDEM, "run", str(REPO / "configs" / "slurm-local-tiny.yaml"), "experiment.name=auto-resume",
           f"experiment.model={tiny_model_dir}", f"experiment.exp_dir={exp.root}", "launcher.gpus_per_node=1",
           "rollout.eval_size=0", "trainer.total_steps=8", "trainer.checkpoint_every=1",
           "launcher.slurm.poll_s=1", "launcher.slurm.auto_resume=3", "launcher.slurm.auto_resume_backoff_s=1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    trainer_jobs: list[str] = []
    down = None
    try:
        for stop in ("time limit", "time limit", "node"):
            job_id = _until("a launch running", lambda: _running_trainer(exp, trainer_jobs[-1] if trainer_jobs else None),
                            proc=proc, log=log)
            trainer_jobs.append(job_id)
            _until("a step of this launch", lambda: _stepped_in_this_launch(exp), proc=proc, log=log)
            if stop == "time limit":
                subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
            else:
                down = _node_of(job_id)
                subprocess.run(["scontrol", "update", f"NodeName={down}", "State=DOWN", "Reason=tandem-test"], check=True)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        if down and "down" in subprocess.run(["sinfo", "-h", "-n", down, "-o", "%t"], capture_output=True,
                                             text=True).stdout:
            subprocess.run(["scontrol", "update", f"NodeName={down}", "State=RESUME"], check=False)
    text = log.read_text()
    assert code == 0, text[-4000:]

    # Decided and recorded three times, each from a step further on.
    recs = continuations(exp)
    assert [(r["event"], r["cause"], r["attempt"]) for r in recs] == [
        (CONTINUED, "TIMEOUT", 1), (CONTINUED, "TIMEOUT", 2), (CONTINUED, "NODE_FAIL", 3)], recs
    assert recs[0]["step"] < recs[1]["step"] < recs[2]["step"]
    assert [r["job_id"] for r in recs[:2]] == trainer_jobs[:2]
    assert text.count("continuing the run from its last checkpoint") == 3, text
    assert f"trainer-0 (job {trainer_jobs[0]}) reached its time limit (TIMEOUT)" in text
    assert "automatic continuation 3 of 3" in text

    # Every step trained, and every group accounted for across the four launches.
    steps = [r["step"] for r in read_metrics(exp, "trainer", "step")]
    assert max(steps) == 8 and set(steps) == set(range(1, 9)), steps
    audit = json.loads(subprocess.run([TANDEM, "audit", "--exp", str(exp.root), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert audit["lost"] == 0 and audit["trained_twice"] == 0 and audit["steps"] == 8, audit

    # The report marks each continuation on its timeline; `tandem status` lists them.
    info = run_info(exp, read_metrics(exp))
    assert info.resume_labels() == ["continued #1: TIMEOUT", "continued #2: TIMEOUT", "continued #3: NODE_FAIL"]
    assert "resumed 3x (3 by the launcher itself)" in (exp.report / "report.html").read_text()
    status = subprocess.run([TANDEM, "status", "--exp", str(exp.root)], capture_output=True, text=True, check=True)
    assert status.stdout.count("continued automatically") == 3, status.stdout
    assert "launcher status 'finished'" in status.stdout
    assert not _squeue_ids() & set(recorded_job_ids(read_record(exp)) + trainer_jobs)


def test_the_same_time_limit_twice_at_the_same_step_stops_the_run(shared_exp, slurm_cluster, capsys):
    """A time limit too short for a single step: the run would loop. The first launch's end is
    real: the test shortens the running trainer job's limit to 1 minute (`scontrol update
    JobId=... TimeLimit=1`), so its `--signal=USR2@90` warning is due at once and slurmctld sends
    it at its next time-limit check (within 30 s); the wrapper stops the role, SLURM records
    FAILED, the wrapper's note makes it TIMEOUT. The second launch's warning is the stand-in of
    the test above (`scancel --signal=USR2`), which saves that wait. Stand-in roles
    (standin_role.py: announce and sleep; the trainer trains no step, so both launches end at
    step 0), launched through the lifecycle and SLURM backend `tandem run` uses and continued by
    the same `keep_going`, with a relaunch that resumes those stand-ins (the real `--resume`
    launch is the test above's). The first end is continued; the second, the same at the same
    step, stops the run with its reason."""
    cfg = load_config(None, ["experiment.name=samefail", f"experiment.exp_dir={shared_exp.root}",
                             "experiment.model=/nonexistent", "launcher.backend=slurm",
                             f"launcher.slurm.partition={slurm_cluster}", "launcher.slurm.time=00:10:00",
                             "launcher.slurm.exclusive=false", "trainer.total_steps=1"])
    policy = SlurmPolicy(poll_s=1.0, ready_timeout_s=90.0)

    def standin(name, kind, **sizing):
        ready = "trainer" if kind == "trainer" else name
        return job(name, [sys.executable, STANDIN, str(shared_exp.root), name, "--ready", ready, "--sleep", "600",
                          "--graceful"], kind=kind, ready_file=ready, **sizing)

    def stack():
        return [standin("controller-0", "controller"), standin("trainer-0", "trainer")]

    trainer_jobs: list[str] = []

    def shorten_the_trainers_limit():
        trainer_jobs.append(_until("the trainer's job", lambda: _running_trainer(
            shared_exp, trainer_jobs[-1] if trainer_jobs else None)))
        if len(trainer_jobs) == 1:   # slurmctld's own warning
            subprocess.run(["scontrol", "update", f"JobId={trainer_jobs[-1]}", "TimeLimit=1"], check=True)
        else:                        # the stand-in's
            subprocess.run(["scancel", "--signal=USR2", trainer_jobs[-1]], check=True)

    def launch_once(resume: bool):
        """One launch of the stand-ins, `tandem run`'s lifecycle on the SLURM backend; a thread
        shortens its trainer's time limit once every role is up."""
        shortener = threading.Thread(target=shorten_the_trainers_limit, daemon=True)
        shortener.start()
        requests = stack()
        backend = SlurmBackend(cfg, shared_exp, policy, requests)
        code = run_experiment(cfg, shared_exp, resume, backend, roles=[r.role for r in requests], join=None)
        shortener.join(timeout=10)
        return code, backend, shared_exp

    code, backend, _ = launch_once(False)
    assert code == 1
    assert keep_going(code, backend, shared_exp, budget=3, base_s=1.0, relaunch=lambda: launch_once(True)) == 1
    recs = continuations(shared_exp)
    assert [(r["event"], r["cause"], r["step"]) for r in recs] == [(CONTINUED, "TIMEOUT", 0),
                                                                    (NOT_CONTINUED, "TIMEOUT", 0)], recs
    err = capsys.readouterr().err
    assert (f"not continuing the run by itself: trainer-0 (job {trainer_jobs[1]}) reached its time limit "
            f"(TIMEOUT) at step 0 again, as the launch before it did: it failed the same way twice in a row at "
            f"the same step") in err, err
    for job_id in trainer_jobs:   # the warning stopped each trainer, before a limit killed it
        wrapper = (shared_exp.logs / "slurm" / f"{job_id}_0_log.out").read_text()
        assert "trainer-0 stopped by SIGUSR2" in wrapper
        assert query_states([job_id])[job_id].state == "FAILED"
    assert len(trainer_jobs) == 2
    limit = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "Timelimit", "-j", trainer_jobs[0]], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert limit == "00:01:00", limit   # the shortened limit slurmctld warned about
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)) + trainer_jobs)
