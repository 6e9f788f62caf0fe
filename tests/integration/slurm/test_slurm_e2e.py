"""A whole tiny experiment through the slurm backend on the local cluster, with the real roles.

2 nodes x 2 (fake) GPUs at 1:1: two embedded generation servers with one GPU each on one node,
a 2-rank trainer (gloo on CPU) on the other, controller, reward service and a rollout worker as
CPU jobs. The model is the random tiny one, so rewards are meaningless; what is checked is that
every role ran as its SLURM job where the plan put it and the run reached its last step.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from launcher.run import prepare
from launcher.slurm_backend import run_slurm
from launcher.slurm_jobs import read_record, recorded_job_ids
from launcher.slurm_requests import SlurmPolicy

pytestmark = pytest.mark.timeout(300)

CONFIG = """\
experiment: {{name: slurm-e2e, exp_dir: {exp_dir}, model: {model}}}
launcher:
  backend: slurm
  nodes: 2
  gpus_per_node: 2
  gen_train_ratio: "1:1"
  slurm: {{partition: {partition}, time: "00:20:00", exclusive: false}}
trainer: {{total_steps: 2, groups_per_step: 2}}
controller: {{groups_per_step: 2}}
rollout: {{n_samples: 2, max_new_tokens: 16}}
"""


def _header(console) -> dict:
    line = console.read_text().splitlines()[0]
    m = re.match(r"\[tandem-slurm\] (\S+) job (\d+) node (\S+) rank (\S+) CUDA_VISIBLE_DEVICES=(\S*)", line)
    assert m, line
    return dict(zip(("name", "job", "node", "rank", "gpus"), m.groups(), strict=True))


def test_tiny_experiment_runs_to_its_last_step_on_the_cluster(slurm_cluster, tiny_model_dir, tmp_path):
    cfg_file = tmp_path / "slurm-tiny.yaml"
    cfg_file.write_text(CONFIG.format(exp_dir=tmp_path / "run", model=tiny_model_dir, partition=slurm_cluster))
    cfg, exp = prepare(str(cfg_file), [], False)
    assert run_slurm(cfg, exp, False, policy=SlurmPolicy(poll_s=1.0, ready_timeout_s=180.0)) == 0

    steps = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    steps = [r for r in steps if r.get("role") == "trainer" and "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sorted(p.name for p in exp.weights.iterdir() if p.name.startswith("v"))[-1] == "v2"
    assert (exp.root / "summary.json").exists()

    gens = [_header(exp.logs / f"gen-{i}.console") for i in (0, 1)]
    ranks = [_header(exp.logs / f"trainer-{r}.console") for r in (0, 1)]
    assert all(len(g["gpus"].split(",")) == 1 for g in gens)          # TP 1: one GPU per server
    assert [r["rank"] for r in ranks] == ["0", "1"] and ranks[0]["job"] == ranks[1]["job"]
    assert all(len(r["gpus"].split(",")) == 2 for r in ranks)          # 2 trainer GPUs on its node
    assert ranks[0]["node"] == ranks[1]["node"]
    assert _header(exp.logs / "controller-0.console")["gpus"] == ""

    # Services published their node's name (TANDEM_ADVERTISE_HOST), not loopback.
    for role in ("controller", "reward", "trainer"):
        info = json.loads(exp.service_file(role).read_text())
        address = info.get("address") or info["trajectory_address"]
        assert re.match(r"tcp://n[12]:\d+$", address), (role, address)

    record = read_record(exp)
    assert record["status"] == "finished"
    live = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert not set(live) & set(recorded_job_ids(record))

    # --resume resubmits every role; the trainer continues from its checkpoint at version 2.
    cfg, exp = prepare(str(cfg_file), ["trainer.total_steps=3"], True)
    assert run_slurm(cfg, exp, True, policy=SlurmPolicy(poll_s=1.0, ready_timeout_s=180.0)) == 0
    steps = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    assert [r["step"] for r in steps if r.get("role") == "trainer" and r.get("event") == "step"] == [1, 2, 3]
    assert (exp.weights / "v3").is_dir()
