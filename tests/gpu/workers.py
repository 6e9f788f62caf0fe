"""Running step_worker.py from a test: a fresh process per backend configuration (see its docstring)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("step_worker.py")


def run_worker(out: Path, *args: str, cpu: bool = False, timeout: float = 240) -> dict:
    """step_worker.py with these arguments; its result dict (fails with its output otherwise).
    TANDEM_GPU_TIER_RECORDS=DIR keeps a copy of each result file there."""
    env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONPATH": str(REPO)}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args), "--out", str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"step_worker {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    keep = os.environ.get("TANDEM_GPU_TIER_RECORDS")
    if keep:   # the raw records, to re-read a comparison off the device (run_tier.sh bundles them)
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / f"{out.parent.name}-{out.name}")
    return torch.load(out, weights_only=False)
