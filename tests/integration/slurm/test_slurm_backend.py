"""The submitit backend on a real SLURM cluster (two virtual nodes with 8 fake GPUs each).

The roles are stand-ins (tests/integration/slurm/standin_role.py: announce, sleep, exit) because the real
role commands need the whole system; the end-to-end run with the real roles is
`configs/slurm-local-tiny.yaml`. Everything SLURM-side is real: sbatch through submitit, srun
tasks on two nodes, GPU allocation, sacct states, scancel.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slurm_launch import job, launch

from tandem.launcher.backends.slurm import SlurmRun
from tandem.launcher.backends.slurm_requests import JobRequest, SlurmPolicy
from tandem.launcher.config import load_config
from tandem.launcher.slurm_jobs import read_record, recorded_job_ids

STANDIN = str(Path(__file__).with_name("standin_role.py"))
FAST = SlurmPolicy(poll_s=1.0, ready_timeout_s=90.0)
pytestmark = pytest.mark.timeout(180)


def _cfg(exp, partition):
    return load_config(None, ["experiment.name=slurmtest", f"experiment.exp_dir={exp.root}",
                              "experiment.model=/nonexistent", "launcher.backend=slurm",
                              f"launcher.slurm.partition={partition}", "launcher.slurm.time=00:10:00",
                              "launcher.slurm.exclusive=false", "trainer.total_steps=1"])


def _standin(exp, name, *extra) -> list[str]:
    return [sys.executable, STANDIN, str(exp.root), name, *extra]


def _wait_file(path: Path, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


def _squeue_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _stack(exp, trainer_exit_after: float = 600.0) -> list[JobRequest]:
    """controller (CPU), one generation server (2 GPUs), a 2-node trainer, one rollout worker."""
    return [
        job("controller-0", _standin(exp, "controller-0", "--ready", "controller", "--sleep", "600"),
            kind="controller", ready_file="controller", restart=True),
        job("gen-0", _standin(exp, "gen-0", "--ready", "gen-0", "--sleep", "600"), kind="gen",
            gpus_per_node=2, ready_file="gen-0", restart=True),
        job("trainer-0", _standin(exp, "trainer", "--ready", "trainer", "--sleep", str(trainer_exit_after)),
            kind="trainer", nodes=2, tasks_per_node=1, gpus_per_node=1, distributed=True, ready_file="trainer"),
        job("rollout-0", _standin(exp, "rollout-0", "--sleep", "600"), kind="rollout", restart=True),
    ]


class _Background:
    """The launcher in a thread, so the test can act on the cluster while the launcher watches."""

    def __init__(self, cfg, exp, requests, policy=FAST):
        self.code = None
        self.thread = threading.Thread(target=self._run, args=(cfg, exp, requests, policy), daemon=True)
        self.thread.start()

    def _run(self, cfg, exp, requests, policy):
        self.code = launch(cfg, exp, False, requests, policy)

    def join(self, timeout_s=120.0):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the launcher did not return"
        return self.code


def _wait_running(exp, timeout_s=120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            record = read_record(exp)
        except (FileNotFoundError, json.JSONDecodeError):
            record = {}
        if record.get("status") == "running":
            return record
        time.sleep(0.3)
    raise AssertionError(f"the run never reached 'running': {record}")


def test_cluster_has_two_nodes_with_eight_gpus(slurm_cluster):
    out = subprocess.run(["sinfo", "-h", "-N", "-p", slurm_cluster, "-o", "%N %t %G"], capture_output=True,
                         text=True, check=True).stdout.split("\n")
    rows = sorted(line.split() for line in out if line.strip())
    assert [r[0] for r in rows] == ["n1", "n2"]
    assert all(r[2] == "gpu:8" for r in rows), rows
    assert all(r[1] in ("idle", "mix", "alloc") for r in rows), rows


def test_gpu_job_sees_its_gpus_and_two_node_job_all_reduces(shared_exp, slurm_cluster):
    """One GPU job (3 GPUs) and one 2-node distributed job (a real gloo all_reduce across nodes)."""
    cfg = _cfg(shared_exp, slurm_cluster)
    run = SlurmRun(cfg, shared_exp, FAST)
    run.submit(job("gen-0", _standin(shared_exp, "gen-0", "--host", "{node}"), kind="gen", gpus_per_node=3))
    run.submit(job("trainer-0", _standin(shared_exp, "trainer", "--all-reduce"), kind="trainer",
                   nodes=2, tasks_per_node=1, gpus_per_node=2, threads=1, distributed=True))
    gen = _wait_file(shared_exp.root / "standin" / "gen-0-0.json")
    ranks = [_wait_file(shared_exp.root / "standin" / f"trainer-{r}.json") for r in (0, 1)]
    assert len(gen["CUDA_VISIBLE_DEVICES"].split(",")) == 3
    assert gen["RANK"] is None
    assert gen["host_arg"] == gen["SLURMD_NODENAME"] in ("n1", "n2")   # {node} became the node's name
    assert [r["all_reduce"] for r in ranks] == [3.0, 3.0]
    assert {r["SLURMD_NODENAME"] for r in ranks} == {"n1", "n2"}
    assert [(r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"]) for r in ranks] == [("0", "2", "0"), ("1", "2", "0")]
    assert ranks[0]["MASTER_ADDR"] == ranks[1]["MASTER_ADDR"] in ("n1", "n2")
    assert all(len(r["CUDA_VISIBLE_DEVICES"].split(",")) == 2 for r in ranks)
    deadline = time.monotonic() + 60
    while (states := run.states()) and any(s.active for s in states.values()):
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    assert {n: s.state for n, s in states.items()} == {"gen-0": "COMPLETED", "trainer-0": "COMPLETED"}
    assert (shared_exp.logs / "trainer-1.console").read_text().count("trainer rank 1 up") == 1


def test_scancel_of_one_role_is_reported_and_tears_down_the_rest(shared_exp, slurm_cluster, capfd):
    cfg = _cfg(shared_exp, slurm_cluster)
    bg = _Background(cfg, shared_exp, _stack(shared_exp))
    record = _wait_running(shared_exp)
    gen_job = record["roles"]["gen-0"]["job_id"]
    subprocess.run(["scancel", gen_job], check=True)
    assert bg.join() == 1
    err = capfd.readouterr().err
    assert f"gen-0 (job {gen_job}) CANCELLED" in err
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)))
    assert read_record(shared_exp)["status"] == "failed"


def test_tandem_cancel_leaves_no_job_in_squeue(shared_exp, slurm_cluster, capfd):
    import argparse

    from tandem.launcher import slurm_cli

    cfg = _cfg(shared_exp, slurm_cluster)
    bg = _Background(cfg, shared_exp, _stack(shared_exp))
    _wait_running(shared_exp)
    parser = argparse.ArgumentParser()
    slurm_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["status", "--exp", str(shared_exp.root)])
    assert args.func(args) == 0
    status = capfd.readouterr().out
    assert all(f"{role}" in status for role in ("controller-0", "gen-0", "trainer-0", "rollout-0"))
    assert "RUNNING" in status
    args = parser.parse_args(["cancel", "--exp", str(shared_exp.root)])
    assert args.func(args) == 0
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)))
    assert bg.join() == 1
    assert read_record(shared_exp)["status"] == "cancelled"


def test_resubmit_policy_restarts_a_role_and_the_run_completes(shared_exp, slurm_cluster):
    """on_failure=resubmit: a killed server comes back as a new job; the trainer then finishes."""
    cfg = _cfg(shared_exp, slurm_cluster)
    requests = _stack(shared_exp, trainer_exit_after=12.0)
    bg = _Background(cfg, shared_exp, requests, SlurmPolicy(poll_s=1.0, ready_timeout_s=90.0,
                                                            on_failure="resubmit", max_resubmits=1))
    record = _wait_running(shared_exp)
    first = record["roles"]["gen-0"]["job_id"]
    subprocess.run(["scancel", first], check=True)
    assert bg.join() == 0
    role = read_record(shared_exp)["roles"]["gen-0"]
    assert role["previous"] == [first] and role["job_id"] != first and role["resubmits"] == 1
    assert (shared_exp.root / "summary.json").exists()
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)))


def test_time_limit_warning_becomes_sigterm_and_the_job_does_not_look_completed(shared_exp, slurm_cluster):
    """SLURM's USR2 (sent before the time limit) reaches the role as SIGTERM; although the role
    then exits 0, the job must end FAILED so the watcher never takes it for a finished trainer."""
    cfg = _cfg(shared_exp, slurm_cluster)
    run = SlurmRun(cfg, shared_exp, FAST)
    run.submit(job("trainer-0", _standin(shared_exp, "trainer", "--ready", "trainer", "--sleep", "120",
                                         "--graceful"), kind="trainer", ready_file="trainer"))
    run.wait_ready(["trainer-0"])
    subprocess.run(["scancel", "--signal=USR2", run.jobs["trainer-0"].job_id], check=True)
    deadline = time.monotonic() + 60
    while (state := run.states()["trainer-0"]).active:
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    assert state.state == "FAILED", state
    assert "got SIGTERM; exiting cleanly" in (shared_exp.logs / "trainer-0.console").read_text()
    wrapper_log = shared_exp.logs / "slurm" / f"{state.job_id}_0_log.out"
    assert "RuntimeError: trainer-0 stopped by SIGUSR2" in wrapper_log.read_text()
    assert str(wrapper_log) in run.why("trainer-0", state)


def test_teardown_gives_the_trainer_its_stop_time_after_the_rollout_workers_stop(shared_exp, slurm_cluster, capfd):
    """A plain cancel leaves a role the cluster's KillWait (5 s here) before SIGKILL; a trainer
    that takes 8 s to write its checkpoint is given `launcher.trainer_stop_s`, once the rollout
    workers' jobs are gone."""
    cfg = _cfg(shared_exp, slurm_cluster)
    run = SlurmRun(cfg, shared_exp, FAST)
    run.submit(job("trainer-0", _standin(shared_exp, "trainer", "--ready", "trainer", "--sleep", "120",
                                         "--graceful", "--stop-s", "8"), kind="trainer", ready_file="trainer"))
    run.submit(job("rollout-0", _standin(shared_exp, "rollout-0", "--sleep", "120"), kind="rollout"))
    run.wait_ready(["trainer-0"])
    assert run.teardown("test", trainer_stop_s=60) == []
    assert "trainer: saved after 8 s" in (shared_exp.logs / "trainer-0.console").read_text()
    assert "stopping the trainer: it saves a checkpoint first" in capfd.readouterr().out
    assert not _squeue_ids() & set(recorded_job_ids(read_record(shared_exp)))


def test_a_role_that_dies_before_it_is_ready_is_reported_and_nothing_else_starts(shared_exp, slurm_cluster, capfd):
    cfg = _cfg(shared_exp, slurm_cluster)
    requests = _stack(shared_exp)
    requests[0] = job("controller-0", _standin(shared_exp, "controller-0", "--exit", "3"), kind="controller",
                      ready_file="controller")
    assert launch(cfg, shared_exp, False, requests, FAST) == 1
    err = capfd.readouterr().err
    assert "controller-0 (job" in err and "FAILED" in err and "ended before it was ready" in err
    assert "controller-0 rank 0 up" in err   # the console tail comes with the report
    record = read_record(shared_exp)
    assert list(record["roles"]) == ["controller-0"] and record["status"] == "failed"


def test_a_second_launch_refuses_while_jobs_of_the_first_still_run(shared_exp, slurm_cluster, capfd):
    """A launcher killed before its teardown leaves jobs behind; `--resume` must not double them."""
    cfg = _cfg(shared_exp, slurm_cluster)
    run = SlurmRun(cfg, shared_exp, FAST)
    run.submit(job("controller-0", _standin(shared_exp, "controller-0", "--sleep", "120")))
    job_id = run.jobs["controller-0"].job_id
    try:
        assert launch(cfg, shared_exp, True, _stack(shared_exp), FAST) == 2
        assert f"still queued or running ({job_id})" in capfd.readouterr().err
        assert list(read_record(shared_exp)["roles"]) == ["controller-0"]   # nothing new submitted
    finally:
        run.teardown("test")


KILLED_LAUNCHER = """
import sys
from tandem.launcher.backends.slurm_requests import SlurmPolicy
from tandem.launcher.config import load_config
from tandem.services.protocol import ExpDir
from slurm_launch import job, launch
exp, partition, standin = ExpDir(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = load_config(None, ["experiment.name=slurmtest", f"experiment.exp_dir={exp.root}", "experiment.model=/nonexistent",
                         "launcher.backend=slurm", f"launcher.slurm.partition={partition}", "launcher.slurm.time=00:10:00",
                         "launcher.slurm.exclusive=false", "trainer.total_steps=1", "launcher.slurm.launcher_lease_s=6",
                         "launcher.trainer_stop_s=30"])
def standin_job(name, kind, *extra, **sizing):
    return job(name, [sys.executable, standin, str(exp.root), name, "--ready", name.split("-")[0] if kind == "trainer"
                      else name, "--sleep", "600", "--graceful", *extra], kind=kind,
               ready_file="trainer" if kind == "trainer" else name, **sizing)
launch(cfg, exp, False, [standin_job("controller-0", "controller"),
                         standin_job("trainer-0", "trainer", "--stop-s", "2", nodes=2, distributed=True)],
       SlurmPolicy(poll_s=1.0, ready_timeout_s=90.0))
"""


def test_jobs_of_a_sigkilled_launcher_stop_their_roles_when_its_lease_runs_out(shared_exp, slurm_cluster):
    """The launcher (a process of its own) is SIGKILLed once its jobs run: no teardown, no
    scancel. Each job's task sees the lease unrenewed for `launcher_lease_s` (6 s here), stops its
    role with SIGTERM — the trainer's two ranks save their checkpoint — and ends FAILED, not
    COMPLETED; nothing is left in squeue, and a --resume is no longer refused."""
    import os

    from tandem.launcher.backends.slurm import live_jobs_of_earlier_launch
    from tandem.launcher.slurm_jobs import query_states

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "support"),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(shared_exp.root / "launcher.console", "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-c", KILLED_LAUNCHER, str(shared_exp.root), slurm_cluster, STANDIN],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    ids: list[str] = []
    try:
        ids = recorded_job_ids(_wait_running(shared_exp))
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 90
        while _squeue_ids() & set(ids):
            assert time.monotonic() < deadline, f"jobs {_squeue_ids() & set(ids)} outlived the lease"
            time.sleep(0.5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if ids:
            subprocess.run(["scancel", *ids], check=False)
    states = query_states(ids)
    assert {s.state for s in states.values()} == {"FAILED"}, states
    for console in ("controller-0", "trainer-0", "trainer-1"):
        text = (shared_exp.logs / f"{console}.console").read_text()
        assert "the launcher renewed no lease for 6 s" in text and "got SIGTERM; exiting cleanly" in text, text
    assert (shared_exp.logs / "trainer-1.console").read_text().count("saved after 2 s") == 1
    wrapper_logs = "".join(p.read_text() for p in (shared_exp.logs / "slurm").glob("*_log.out"))
    assert "stopped by its launcher's lease (no heartbeat for 6 s)" in wrapper_logs
    assert live_jobs_of_earlier_launch(shared_exp) == []
