"""`tandem scale` on the local SLURM cluster: a generation server added mid-run is a new job on
the node the request allows, caught up before it takes requests; the original server's job is
cancelled once the controller has retired it, and the run trains on with nothing lost.

Real: the launcher (`tandem run`, slurm backend, configs/slurm-local-tiny.yaml with one server and
one trainer rank), every role a SLURM job, `tandem scale` typed in another shell, sbatch's
`--exclude`, slurmctld's job states. The run is stopped (SIGTERM, as Ctrl-C) once the newcomer
alone has served a few steps; the audit then accounts for every group.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from controller_status import controller_state
from polling import until

from tandem.launcher.audit import audit
from tandem.launcher.slurm_jobs import query_states, read_record, recorded_job_ids
from tandem.services.protocol import ExpDir, read_metrics, read_service

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).resolve().parents[3]


def _node(console: Path) -> str:
    """The node a role's job ran on (the first line its wrapper writes, launcher/slurm_task.py)."""
    return re.search(r" node (\S+) ", console.read_text().splitlines()[0]).group(1)


def _step(exp: ExpDir) -> int:
    done = read_metrics(exp, "trainer", "step")
    return done[-1]["step"] if done else 0


def _scale(exp: ExpDir, *args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "scale", "--exp", str(exp.root),
                           "--timeout", "300", *args], capture_output=True, text=True, timeout=330)
    return done.returncode, done.stdout + done.stderr


def test_a_server_joins_on_another_node_and_the_first_one_leaves(slurm_cluster, tiny_model_dir, tmp_path):
    exp = ExpDir(tmp_path / "exp")
    out_file = tmp_path / "launcher.out"
    with open(out_file, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "run",
                                str(REPO / "configs" / "slurm-local-tiny.yaml"), "experiment.name=scale",
                                f"experiment.model={tiny_model_dir}", f"experiment.exp_dir={exp.root}",
                                "launcher.gpus_per_node=1", "rollout.eval_size=0", "trainer.total_steps=1000",
                                "launcher.slurm.poll_s=1"],
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        until("a step", lambda: _step(exp) >= 1 or run.poll() is not None, 240)
        assert run.poll() is None, out_file.read_text()[-3000:]
        # The controller at version 1 (the trainer's step record can come first): a server joining
        # now holds older weights than the current ones, so it must be caught up.
        until("version 1", lambda: controller_state(exp)["version"] >= 1)
        first = _node(exp.logs / "gen-0.console")
        code, text = _scale(exp, "--add", "1", "--exclude", first)
        assert code == 0 and "gen-1 joined the run" in text and "in rotation" in text, text
        assert _node(exp.logs / "gen-1.console") != first
        address = read_service(exp, "gen-1")["url"].rstrip("/")
        caught = [r for r in read_metrics(exp, "controller")
                  if r.get("event") == "catch_up" and r.get("server", "").rstrip("/") == address]
        assert caught and caught[0]["ok"] and caught[0]["version"] >= 1, caught

        gen0_job = read_record(exp)["roles"]["gen-0"]["job_id"]
        code, text = _scale(exp, "--server", "gen-0")
        assert code == 0 and "gen-0 left the run" in text, text
        assert not query_states([gen0_job])[gen0_job].active
        left_at = _step(exp)
        until("2 steps on gen-1 alone", lambda: _step(exp) >= left_at + 2 or run.poll() is not None)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 130, out_file.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "cancel", "--exp", str(exp.root)], check=False)
    result = audit(exp)
    assert not result.lost and not result.trained_twice, result.as_dict()
    assert [c["label"] for c in result.server_changes] == ["gen-1 joined", "gen-0 left"]
    live = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert not set(live) & set(recorded_job_ids(read_record(exp)))
