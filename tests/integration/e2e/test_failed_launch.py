"""A launch that fails before it trains leaves nothing that stops the same command from starting
again: before, its directory held a config, so the second `tandem run` was refused with "already
holds an experiment; pass --resume" for a run that had never trained. The first launch here fails
as a user's does: the model directory has the files the checks read but no weights a role can
load (tests/support/model_dirs.py), so every generation server fails at start."""
from __future__ import annotations

import subprocess
import sys

from local_run import leftovers, write_config
from model_dirs import checked_model_dir

from tandem.services.protocol import ExpDir


def test_the_same_command_starts_again_after_a_launch_that_never_trained(tmp_path):
    model = checked_model_dir(tmp_path / "model")
    cfg = write_config(tmp_path / "exp.yaml", model, "again")
    exp = ExpDir(tmp_path / "again")
    command = [sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and exp.config.exists(), first.stdout[-2000:] + first.stderr[-2000:]
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert "already holds an experiment" not in out, out[-3000:]
    assert f"{exp.root} held a launch that never trained; moved it to {exp.root}.failed-" in out, out[-3000:]
    (aside,) = tmp_path.glob("again.failed-*")
    assert (aside / "config.yaml").exists() and any((aside / "logs").iterdir())   # the first launch's logs
    assert exp.config.exists() and second.returncode == first.returncode   # it started again, and failed again
    assert leftovers(exp) == []
