"""docs/cluster.md's local-cluster commands, run as written on a fresh copy of the checkout, with
the real roles through the slurm backend.

The fresh copy holds what a clone holds that the commands touch (`configs/`, the virtualenv
linked in) and nothing built: no `.cache/tiny-model`, no `runs/`. The commands are read from the
doc's code block, so a doc that drifts from what works fails here. `start.sh` / `stop.sh` are left
to the session's cluster fixture (stopping the cluster would end the other SLURM tests), and
`sudo` is dropped (the tests run as root).

`configs/slurm-local-tiny.yaml`: 2 nodes x 2 (fake) GPUs at 1:1 — two embedded generation
servers with one GPU each on one node, a 2-rank trainer (gloo on CPU) on the other, controller,
reward service, rollout worker and the two evaluations as CPU jobs. The model is the random tiny
one, so rewards are meaningless; what is checked is that every role ran as its SLURM job where
the plan put it, the run reached its last step, and it ended as a local run ends (the same
summary, evaluation included, and report).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.launcher.slurm_jobs import read_record, recorded_job_ids
from tandem.services.protocol import ExpDir

pytestmark = pytest.mark.timeout(420)
REPO = Path(__file__).resolve().parents[3]
SUMMARY_KEYS = {"steps", "eval", "staleness", "throughput", "weight_sync", "wall_s", "rl_s", "warnings", "stopped",
                "verdict"}


def documented_commands() -> list[str]:
    """The bash block under "Trying it on a laptop: the local cluster" in docs/cluster.md."""
    text = (REPO / "docs" / "cluster.md").read_text()
    section = text[text.index("## Trying it on a laptop"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [re.sub(r"^sudo ", "", line) for line in lines if line]


def _header(console) -> dict:
    line = console.read_text().splitlines()[0]
    m = re.match(r"\[tandem-slurm\] (\S+) job (\d+) node (\S+) rank (\S+) CUDA_VISIBLE_DEVICES=(\S*)", line)
    assert m, line
    return dict(zip(("name", "job", "node", "rank", "gpus"), m.groups(), strict=True))


def _run(command: str, cwd: Path) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"`{command}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_documented_local_cluster_commands_run_a_tiny_experiment(slurm_cluster, tmp_path):
    commands = documented_commands()
    assert any("tandem run configs/slurm-local-tiny.yaml" in c for c in commands), commands
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copytree(REPO / "configs", clone / "configs")
    (clone / ".venv").symlink_to(REPO / ".venv")
    for command in commands:
        if "local-cluster/" in command:
            continue   # start.sh / stop.sh: the session fixture's
        _run(command, clone)

    exp = ExpDir(clone / "runs" / "slurm-local-tiny")
    steps = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    steps = [r for r in steps if r.get("role") == "trainer" and r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert sorted(p.name for p in exp.weights.iterdir() if p.name.startswith("v"))[-1] == "v2"

    # The run ends as a local run ends: the same summary keys, evaluation included, and the report.
    summary = json.loads((exp.root / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS and summary["steps"] == 2
    assert summary["eval"]["before"] is not None and summary["eval"]["after"] is not None
    assert summary["eval"]["n"] > 0
    assert (exp.report / "report.html").exists() and (exp.report / "report.png").stat().st_size > 10_000

    gens = [_header(exp.logs / f"gen-{i}.console") for i in (0, 1)]
    ranks = [_header(exp.logs / f"trainer-{r}.console") for r in (0, 1)]
    assert all(len(g["gpus"].split(",")) == 1 for g in gens)          # TP 1: one GPU per server
    assert [r["rank"] for r in ranks] == ["0", "1"] and ranks[0]["job"] == ranks[1]["job"]
    assert all(len(r["gpus"].split(",")) == 2 for r in ranks)          # 2 trainer GPUs on its node
    assert ranks[0]["node"] == ranks[1]["node"]
    assert _header(exp.logs / "controller-0.console")["gpus"] == ""
    assert _header(exp.logs / "eval-before.console")["gpus"] == ""

    # Services published their node's name (TANDEM_ADVERTISE_HOST), not loopback.
    for role in ("controller", "reward", "trainer"):
        info = json.loads(exp.service_file(role).read_text())
        address = info.get("address") or info["trajectory_address"]
        assert re.match(r"tcp://n[12]:\d+$", address), (role, address)

    record = read_record(exp)
    assert record["status"] == "finished"
    live = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert not set(live) & set(recorded_job_ids(record))

    # --resume resubmits every role; the trainer continues from its checkpoint at version 2. This
    # launch also passes its versions through the weight relay (gen.weight_relay): both servers'
    # jobs run on one node, so they share that node's copy (a chain of one node). Its held-out
    # evaluation is off: the first launch's was checked above, and this one's job (10 s on 2
    # cores) would check nothing more.
    _run(".venv/bin/tandem run configs/slurm-local-tiny.yaml trainer.total_steps=3 gen.weight_relay=true "
         "rollout.eval_size=0 --resume", clone)
    records = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r.get("role") == "trainer" and r.get("event") == "step"] == [1, 2, 3]
    assert (exp.weights / "v3").is_dir()
    gens = [json.loads(exp.service_file(f"gen-{i}").read_text()) for i in (0, 1)]
    assert all(re.match(r"n[12]:\d+$", g["relay"]) for g in gens), gens
    assert gens[0]["relay_node"] == gens[1]["relay_node"]
    (relayed,) = [r for r in records if r.get("event") == "weight_sync" and r["version"] == 3]
    assert "relay" in relayed["phases"] and not relayed["failed"] and len(relayed["updated"]) == 2, relayed
    node_dir = Path(gens[0]["relay_node"].split(":", 1)[1])
    assert not node_dir.exists()      # removed when the node's last server stopped
    # What the jobs wrote is the user's alone, as on one machine (services/protocol/private.py):
    # every role sets its umask from the run's config on whichever node it landed.
    loose = [f"{p} {oct(p.lstat().st_mode & 0o777)}" for p in [exp.root, *exp.root.rglob("*")]
             if not p.is_symlink() and p.lstat().st_mode & 0o077]
    assert loose == [], loose
