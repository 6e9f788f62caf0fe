"""`gen.backend: sglang` through the slurm backend on the local cluster, with a STAND-IN for SGLang.

The generation job is the real one `job_requests` builds (`tandem gen sglang ...`, which runs
`python -m sglang.launch_server`); SGLang needs CUDA, so `tests/integration/launcher/standin_sglang/` is first
on the jobs' PYTHONPATH and that module is a small script (NOT SGLang; see its docstring) that
records its argv and environment and serves `/ready`, `/model_info`, `/v1/loads` over HTTP. The
controller job and the registration are real; the trainer is a stand-in that announces itself and
ends when the test says so (the real one needs the whole system). The fake GPUs are the local
cluster's (SLURM's gres allocation sets CUDA_VISIBLE_DEVICES; nothing uses a device).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from model_dirs import checked_model_dir
from polling import until

from tandem.launcher.backends.slurm import SlurmBackend
from tandem.launcher.backends.slurm_requests import SlurmPolicy, job_requests
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.roles import Role, experiment_roles
from tandem.launcher.run import prepare
from tandem.launcher.slurm_jobs import read_record, recorded_job_ids
from tandem.services.protocol import StatusRequest, SyncRequestClient, load_keys, read_service

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
STANDIN = REPO / "tests" / "integration" / "launcher" / "standin_sglang"
# Announces the trainer, then waits for <exp>/finish: the run ends when the test has seen enough.
TRAINER = ("import json, os, pathlib, sys, time\n"
           "exp = pathlib.Path(sys.argv[1])\n"
           "(exp / 'services' / 'trainer.json').write_text(json.dumps({'pid': os.getpid()}))\n"
           "while not (exp / 'finish').exists(): time.sleep(0.2)\n")

CONFIG = """\
experiment: {{name: slurm-sgl, exp_dir: {exp_dir}, model: {model}}}
launcher:
  backend: slurm
  nodes: 2
  gpus_per_node: 2
  gen_train_ratio: "1:1"
  slurm: {{partition: {partition}, time: "00:10:00", exclusive: false}}
gen: {{backend: sglang, tp_size: 2}}
"""


def test_sglang_gen_job_runs_sglang_launcher_and_registers(slurm_cluster, tmp_path, monkeypatch):
    records = tmp_path / "standin-records"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STANDIN), str(REPO),
                                                                 os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("TANDEM_STANDIN_SGLANG_RECORDS", str(records))
    model = checked_model_dir(tmp_path / "model")
    cfg_file = tmp_path / "sgl.yaml"
    cfg_file.write_text(CONFIG.format(exp_dir=tmp_path / "run", model=model, partition=slurm_cluster))
    cfg, exp = prepare(str(cfg_file), [], False)

    backend = SlurmBackend(cfg, exp, SlurmPolicy(poll_s=1.0, ready_timeout_s=180.0))
    backend.check_can_start()
    roles = [r for r in experiment_roles(cfg, exp, False, backend.gen_host, backend.pick_port)
             if r.name in ("controller-0", "gen-0")]
    (gen,) = job_requests(cfg, [r for r in roles if r.kind == "gen"], backend.plan)
    command = gen.role.command
    assert command[command.index("tandem.launcher.cli") + 1:][:2] == ["gen", "sglang"] and gen.gpus_per_node == 2
    roles.append(Role("trainer-0", [sys.executable, "-c", TRAINER, str(exp.root)], kind="trainer",
                      ready_file="trainer"))
    result = {}
    bg = threading.Thread(target=lambda: result.setdefault(
        "code", run_experiment(cfg, exp, False, backend, roles=roles)), daemon=True)
    bg.start()
    try:
        info = until("gen-0 announced", lambda: exp.service_file("gen-0").exists()
                     and json.loads(exp.service_file("gen-0").read_text()))
        (rec,) = [json.loads(p.read_text()) for p in records.glob("*.json")]
        # SGLang's launcher ran in the gen job, on the job's two GPUs, bound to the node's name.
        argv = rec["argv"]
        assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--host") + 1] in ("n1", "n2")
        assert len(rec["cuda_visible_devices"].split(",")) == 2
        assert "--api-key" not in argv and rec["api_key"] == (exp.keys / "gen-api-key").read_text().strip()
        assert rec["sglang_env"] == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
        assert info["backend"] == "sglang" and info["url"].startswith(f"http://{argv[argv.index('--host') + 1]}:")

        controller = read_service(exp, "controller", timeout_s=30)

        def healthy():
            client = SyncRequestClient(load_keys(exp.keys), controller["address"], timeout_s=30)
            try:
                servers = client.request(StatusRequest()).state["servers"]
            finally:
                client.close()
            return [s for s in servers if s["address"] == info["url"] and s["healthy"]]
        until("the controller seeing the SGLang server healthy", healthy)
        (exp.root / "finish").write_text("")
        bg.join(120)
        assert result.get("code") == 0
    finally:
        (exp.root / "finish").write_text("")
        bg.join(120)
    live = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    assert not set(live) & set(recorded_job_ids(read_record(exp)))
    # The gen job's cancellation stopped SGLang (the role stops its process group).
    until("SGLang stopped with its job", lambda: not Path(f"/proc/{rec['pid']}").exists()
          or Path(f"/proc/{rec['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"), 60)
