"""Automatic continuation (`launcher.slurm.auto_resume`, launcher/continuation.py) on the local
SLURM cluster: the launcher resumes a run by itself after the cluster ends one of its jobs, and
stops instead of looping when it fails the same way twice at the same step.

What is real and what stands in, test by test, is in each docstring. Everything SLURM-side is
the cluster's own: sbatch, srun tasks, sacct's states, slurmctld's time limits and node states.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from polling import until
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


def _until(what: str, check, timeout_s: float = 90.0):
    return until(what, check, timeout_s)


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


def _squeue_ids() -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True).stdout.split())


def test_a_run_continues_by_itself_past_the_trainers_and_the_launchers_time_limits(slurm_cluster, tiny_model_dir,
                                                                                   tmp_path):
    """The launcher runs as a SLURM job of its own (`sbatch slurm/train.sbatch`), the real roles as
    jobs (configs/slurm-local-tiny.yaml with one generation server and one trainer rank), and the
    run trains its 6 steps across two automatic continuations with nobody acting but the cluster
    (and the test standing in for it):

    1. the trainer's job gets SLURM's time-limit warning. Stand-in: the test sends it
       (`scancel --signal=USR2`, the signal and the tasks slurmctld signals at `--signal=USR2@90`)
       once the launch has trained a step, instead of waiting out a limit of whole minutes; the
       rest is real — the job's wrapper turns it into SIGTERM, the trainer checkpoints and exits,
       SLURM records the job FAILED and the wrapper's note makes it TIMEOUT for the launcher,
       which continues the run itself (the `--resume` launch: new jobs for every role, the
       trainer from its checkpoint). test_a_lost_node_is_continued_and_the_same_end_twice_stops
       has slurmctld send the warning.
    2. the launcher's own job nears its limit. Stand-in: the test sends the warning the script
       asks for (`scancel --batch --signal=USR1`, what `--signal=B:USR1@300` sends); real: the
       launcher stops the run (the trainer checkpoints), requeues its job with `scontrol requeue`,
       and SLURM runs the script again under the same job id, which launches with `--resume`.
       SLURM holds a requeued job about two minutes before it may start; the test lifts that
       hold three seconds after the requeue (`scontrol update JobId=... StartTime=now`).

    The audit then finds nothing lost or trained twice across the three launches, and `tandem
    status`, the metrics and the report say each continuation."""
    exp = ExpDir(tmp_path / "exp")
    overrides = ["experiment.name=auto-resume", f"experiment.model={tiny_model_dir}", f"experiment.exp_dir={exp.root}",
                 "launcher.gpus_per_node=1", "rollout.eval_size=0", "trainer.total_steps=6", "trainer.checkpoint_every=1",
                 "launcher.slurm.poll_s=1", "launcher.slurm.auto_resume=3", "launcher.slurm.auto_resume_backoff_s=1"]
    env = {**os.environ, "TANDEM_CONFIG": str(REPO / "configs" / "slurm-local-tiny.yaml"),
           "TANDEM_OVERRIDES": " ".join(overrides), "TANDEM_VENV": str(Path(sys.executable).parents[1])}
    launcher = subprocess.run(["sbatch", "--parsable", "--export=ALL", str(REPO / "slurm" / "train.sbatch")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    log = tmp_path / f"tandem-launcher-{launcher}.out"

    def alive():
        if launcher not in _squeue_ids():
            raise AssertionError(f"the launcher's job ended early:\n{log.read_text()[-4000:] if log.exists() else ''}")

    def until(what, check, timeout_s=90.0):
        return _until(what, lambda: alive() or check(), timeout_s)

    trainer_jobs: list[str] = []
    try:
        for stop in ("trainer's time limit", "launcher's time limit"):
            trainer_jobs.append(until("a launch running", lambda: _running_trainer(
                exp, trainer_jobs[-1] if trainer_jobs else None)))
            until("a step of this launch", lambda: _stepped_in_this_launch(exp))
            if stop == "trainer's time limit":
                subprocess.run(["scancel", "--signal=USR2", trainer_jobs[-1]], check=True)
            else:
                subprocess.run(["scancel", "--batch", "--signal=USR1", launcher], check=True)
                until("the launcher's job requeued", lambda: "BeginTime" in subprocess.run(
                    ["squeue", "-h", "-j", launcher, "-o", "%r"], capture_output=True, text=True).stdout, 120)
                # slurmd refuses a job's credential made in the second it revoked the job's last one
                # ("Job credential revoked"): SLURM's own hold is far longer than that.
                time.sleep(3)
                subprocess.run(["scontrol", "update", f"JobId={launcher}", "StartTime=now"], check=True)
        _until("the launcher's job to end", lambda: launcher not in _squeue_ids(), 180)
    finally:
        subprocess.run(["scancel", launcher], check=False)
    text = log.read_text()
    assert query_states([launcher])[launcher].state == "COMPLETED", text[-4000:]
    assert f"train.sbatch: job {launcher} (run 1)" in text, text[-4000:]   # the requeued run, with --resume

    # Decided and recorded twice, the second from a step further on.
    recs = continuations(exp)
    assert [(r["event"], r["failed_role"], r["cause"], r["job_id"]) for r in recs] == [
        (CONTINUED, "trainer-0", "TIMEOUT", trainer_jobs[0]), (CONTINUED, "launcher", "TIMEOUT", launcher)], recs
    assert recs[0]["step"] < recs[1]["step"], recs
    assert f"trainer-0 (job {trainer_jobs[0]}) reached its time limit (TIMEOUT) at step {recs[0]['step']}: " \
           f"continuing the run from its last checkpoint in 1 s (automatic continuation 1 of 3" in text
    assert f"launcher (job {launcher}) reached its time limit (TIMEOUT) at step {recs[1]['step']}: requeueing job " \
           f"{launcher}" in text

    # Every step trained, and every group accounted for across the three launches.
    steps = [r["step"] for r in read_metrics(exp, "trainer", "step")]
    assert max(steps) == 6 and set(steps) == set(range(1, 7)), steps
    audit = json.loads(subprocess.run([TANDEM, "audit", "--exp", str(exp.root), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert audit["lost"] == 0 and audit["trained_twice"] == 0 and audit["steps"] == 6, audit

    # The report marks each continuation on its timeline; `tandem status` lists them.
    info = run_info(exp, read_metrics(exp))
    assert info.resume_labels() == ["continued #1: TIMEOUT", "continued #2: TIMEOUT"]
    assert "resumed 2x (2 by the launcher itself)" in (exp.report / "report.html").read_text()
    status = subprocess.run([TANDEM, "status", "--exp", str(exp.root)], capture_output=True, text=True, check=True)
    assert status.stdout.count("continued automatically") == 2, status.stdout
    assert "launcher status 'finished'" in status.stdout
    assert not _squeue_ids() & set(recorded_job_ids(read_record(exp)) + trainer_jobs)


def _resume_node(node: str) -> None:
    state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
    if "down" in state or "drain" in state:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)


def test_a_lost_node_is_continued_and_the_same_end_twice_stops(shared_exp, slurm_cluster, capsys):
    """Four launches of a stand-in trainer (standin_role.py: announce and sleep; it trains no
    step, so every launch ends at step 0) through the lifecycle and SLURM backend `tandem run`
    uses, continued by the same `keep_going`, with a relaunch that resumes those stand-ins (the
    real `--resume` launch is the test above's); every job on n2. The ends are real:

    1. slurmctld's own time limit: the test shortens the running job's limit to 1 minute
       (`scontrol update JobId=... TimeLimit=1`), so its `--signal=USR2@90` warning is due at once
       and slurmctld sends it at its next time-limit check (within 30 s); the wrapper stops the
       role, SLURM records FAILED, the wrapper's note makes it TIMEOUT: continued.
    2. the trainer is preempted: a job of the cluster's urgent partition (a higher PriorityTier,
       slurm/local-cluster/slurm.conf.in) asks for all of n2, and slurmctld cancels the trainer's
       job to make room, recording PREEMPTED: another end than the first, so continued.
    3. the trainer's node is lost: `scontrol update NodeName=n2 State=DOWN` makes slurmctld kill
       the job and record NODE_FAIL (the node answers again at once, ReturnToService=2; the test
       resumes it if not): continued.
    4. the node is lost again at the same step: the same end twice in a row, so the launcher
       stops, saying why, instead of looping."""
    cfg = load_config(None, ["experiment.name=samefail", f"experiment.exp_dir={shared_exp.root}",
                             "experiment.model=/nonexistent", "launcher.backend=slurm",
                             f"launcher.slurm.partition={slurm_cluster}", "launcher.slurm.time=00:10:00",
                             "launcher.slurm.exclusive=false", "launcher.slurm.extra.nodelist=n2",
                             "trainer.total_steps=1"])
    policy = SlurmPolicy(poll_s=1.0, ready_timeout_s=90.0)
    trainer_jobs: list[str] = []

    def end_the_trainers_job():
        trainer_jobs.append(_until("the trainer's job", lambda: _running_trainer(
            shared_exp, trainer_jobs[-1] if trainer_jobs else None)))
        if len(trainer_jobs) == 1:
            subprocess.run(["scontrol", "update", f"JobId={trainer_jobs[-1]}", "TimeLimit=1"], check=True)
        elif len(trainer_jobs) == 2:
            urgent = subprocess.run(["sbatch", "--parsable", "-p", f"{slurm_cluster}-urgent", "-w", "n2", "--exclusive",
                                     "-o", "/dev/null", "--wrap", "sleep 60"], capture_output=True, text=True,
                                    check=True).stdout.strip()
            try:
                _until("the job preempted", lambda: trainer_jobs[-1] not in _squeue_ids())
            finally:
                subprocess.run(["scancel", urgent], check=False)
                _until("n2 free again", lambda: urgent not in _squeue_ids())
        else:
            subprocess.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=tandem-test"], check=True)
            _until("the job gone", lambda: trainer_jobs[-1] not in _squeue_ids())
            _resume_node("n2")

    def launch_once(resume: bool):
        """One launch of the stand-in; a thread ends its trainer's job once it is up."""
        ender = threading.Thread(target=end_the_trainers_job, daemon=True)
        ender.start()
        requests = [job("trainer-0", [sys.executable, STANDIN, str(shared_exp.root), "trainer-0", "--ready", "trainer",
                                      "--sleep", "600", "--graceful"], kind="trainer", ready_file="trainer")]
        backend = SlurmBackend(cfg, shared_exp, policy, requests)
        code = run_experiment(cfg, shared_exp, resume, backend, roles=[r.role for r in requests], join=None)
        ender.join(timeout=30)
        return code, backend, shared_exp

    try:
        code, backend, _ = launch_once(False)
        assert code == 1
        assert keep_going(code, backend, shared_exp, budget=4, base_s=1.0, relaunch=lambda: launch_once(True)) == 1
    finally:
        _resume_node("n2")
    recs = continuations(shared_exp)
    assert [(r["event"], r["cause"], r["step"], r["job_id"]) for r in recs] == [
        (CONTINUED, "TIMEOUT", 0, trainer_jobs[0]), (CONTINUED, "PREEMPTED", 0, trainer_jobs[1]),
        (CONTINUED, "NODE_FAIL", 0, trainer_jobs[2]), (NOT_CONTINUED, "NODE_FAIL", 0, trainer_jobs[3])], recs
    err = capsys.readouterr().err
    assert (f"not continuing the run by itself: trainer-0 (job {trainer_jobs[3]}) lost its node (NODE_FAIL) at "
            f"step 0 again, as the launch before it did: it failed the same way twice in a row at the same "
            f"step") in err, err
    # slurmctld's warning stopped the first trainer before its (shortened) limit could kill it.
    assert "trainer-0 stopped by SIGUSR2" in (shared_exp.logs / "slurm" / f"{trainer_jobs[0]}_0_log.out").read_text()
    first = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State,Timelimit", "-j", trainer_jobs[0]],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert first == "FAILED|00:01:00", first
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)) + trainer_jobs)
