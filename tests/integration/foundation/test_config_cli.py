"""Each class of config mistake gives one clear message and exit status 2 (the real CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import load_config

REPO = Path(__file__).resolve().parents[3]


def tandem(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tandem.launcher.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def write(tmp_path, text, name="exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,override,expect", [
    (GOOD_EXPERIMENT.replace("lr:", "lrr:"), None, ["exp.yaml:8", "trainer.optim.lrr", "unknown key",
                                         "did you mean 'trainer.optim.lr'"]),
    (GOOD_EXPERIMENT.replace("groups_per_step: 8", "groups_per_step: lots"), None,
     ["exp.yaml:5", "trainer.groups_per_step", "wrong type"]),
    (GOOD_EXPERIMENT.replace("  model: /models/tiny\n", ""), None, ["missing required value", "experiment.model"]),
    (GOOD_EXPERIMENT.replace("name: demo", "name: [demo"), None, ["exp.yaml:3", "YAML syntax error", "at line 2"]),
    (GOOD_EXPERIMENT.replace("ppo_n_minibatches: 2", "ppo_n_minibatches: 3"), None,
     ["exp.yaml:6", "trainer.ppo_n_minibatches", "not divisible"]),
    (GOOD_EXPERIMENT, "trainer.optim.lrx=1", ["override 'trainer.optim.lrx=1'", "did you mean 'trainer.optim.lr'"]),
    (GOOD_EXPERIMENT, "controller.max_staleness=-1", ["controller.max_staleness", "must be >= 0"]),
    (GOOD_EXPERIMENT, "controller.groups_per_step=3", ["controller.groups_per_step", "trainer.groups_per_step"]),
    (GOOD_EXPERIMENT, "nonsense", ["override 'nonsense'", "key=value"]),
    (GOOD_EXPERIMENT.replace("lr: 1.0e-5", "lr: .nan"), None, ["exp.yaml:8", "trainer.optim.lr", "finite"]),
    (GOOD_EXPERIMENT, "reward.correct_reward=inf", ["reward.correct_reward", "must be a finite number"]),
    ("- a\n- b\n", None, ["top level must be a mapping"]),
    (GOOD_EXPERIMENT.replace("experiment:", "experimnt:"), None, ["experimnt", "did you mean 'experiment'"]),
])
def test_config_mistakes_exit_2_with_a_clear_message(tmp_path, text, override, expect):
    path = write(tmp_path, text)
    r = tandem("config", "check", path, *([override] if override else []))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    for needle in expect:
        assert needle in r.stderr, (needle, r.stderr)
    # one line for the mistake (and one for its model, /models/tiny, which is not there); the
    # hint after a missing file, in parentheses, says what else to run
    lines = r.stderr.strip().splitlines()
    assert len([line for line in lines if not line.startswith("(")]) <= 3, lines


def test_missing_file(tmp_path):
    r = tandem("config", "check", tmp_path / "nope.yaml")
    assert r.returncode == 2 and "no such file" in r.stderr


def test_show_applies_overrides_and_interpolation(tmp_path):
    path = write(tmp_path, GOOD_EXPERIMENT)
    r = tandem("config", "show", path, "trainer.groups_per_step=4", "trainer.ppo_n_minibatches=4",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "groups_per_step: 4" in r.stdout
    # controller.groups_per_step interpolates trainer.groups_per_step; exp_dir is absolute.
    cfg = load_config(path, ["trainer.groups_per_step=4", "trainer.ppo_n_minibatches=4"])
    assert cfg.controller.groups_per_step == 4
    assert Path(cfg.experiment.exp_dir).is_absolute() and cfg.experiment.exp_dir.endswith("runs/demo")


def test_a_reader_that_leaves_early_is_no_error(tmp_path):
    """`tandem audit | head`, `tandem config show ... | head -1`: the reader closes the pipe before
    the command has written everything. That ended in a BrokenPipeError traceback; it is a normal
    end (exit 0, nothing on stderr)."""
    r, w = os.pipe()
    os.close(r)   # the reader is gone before the first byte
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "config", "show", str(REPO / "configs/math-tiny.yaml")],
                          stdout=w, stderr=subprocess.PIPE, text=True, cwd=REPO)
    os.close(w)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
