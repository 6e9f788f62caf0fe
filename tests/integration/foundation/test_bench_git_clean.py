"""`make bench` leaves the checkout as git sees it: a real benchmark, run as `make bench` runs
each one (`python -m benchmarks NAME`, full size), changes nothing `git status` shows.

The benchmark is `protocol` (a few seconds: codec throughput and ZeroMQ round trips). Its
result must land in this run's own directory under benchmarks/runs/ (printed as `results:`),
and the committed benchmarks/results/protocol.json, which docs/controller.md cites, must be
byte-identical afterwards. The run directory is removed at the end.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(240)


def _git_status() -> str:
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "benchmarks/"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"the checkout is not a git work tree here: {proc.stderr.strip()}")
    return proc.stdout


def test_a_benchmark_run_changes_nothing_git_tracks():
    before = _git_status()
    committed = (REPO / "benchmarks/results/protocol.json").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "protocol"], cwd=REPO, capture_output=True,
                          text=True, timeout=200)
    found = re.search(r"^results: (\S+protocol\.json)", proc.stdout, re.M)
    run_dir = (REPO / found.group(1)).parent if found else None
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert found, proc.stdout[-2000:]
        assert run_dir.is_relative_to(REPO / "benchmarks" / "runs"), run_dir
        assert json.loads((run_dir / "protocol.json").read_text())["rtt_us_plain"] > 0
        assert (REPO / "benchmarks/results/protocol.json").read_bytes() == committed
        assert _git_status() == before
    finally:
        if run_dir is not None and run_dir.is_relative_to(REPO / "benchmarks" / "runs"):
            shutil.rmtree(run_dir, ignore_errors=True)
