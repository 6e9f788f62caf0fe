"""`tandem config check` and `tandem run` refuse what a launch would trip on, with one line each
and exit status 2, before anything starts (the real CLI; the checks themselves are unit-tested
in tests/unit/launcher/test_preflight.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from model_dirs import checked_model_dir

REPO = Path(__file__).resolve().parents[3]


def tandem(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "tandem.launcher.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_config_check_runs_the_plans_layout_check():
    r = tandem("config", "check", "configs/math-r1-1.5b.yaml", "gen.tp_size=3", "--skip-files")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("tandem: config error: command line: gen.tp_size=3 does not divide "
                                "launcher.gpus_per_node=8: some tensor-parallel group would straddle two nodes")


def test_run_refuses_a_missing_data_set_at_once(tmp_path):
    model = checked_model_dir(tmp_path / "model")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"experiment: {{name: pre, model: {model}, exp_dir: {tmp_path / 'run'}}}\n")
    t0 = time.monotonic()
    r = tandem("run", cfg, f"rollout.dataset={tmp_path / 'nope.jsonl'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    error, hint = r.stderr.strip().splitlines()
    assert error == (f"tandem: config error: command line: rollout.dataset: "
                     f"{tmp_path / 'nope.jsonl'}: no such file or directory")
    assert hint == "(the files a run reads are checked where you run this; `tandem config check FILE " \
                   "--skip-files` checks the rest alone)"
    assert time.monotonic() - t0 < 60 and not (tmp_path / "run").exists()
