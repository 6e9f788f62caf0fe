"""A real run's records, replayed: `tandem run configs/math-tiny.yaml trainer.total_steps=10
rollout.eval_size=0 rollout.eval_every=0` on a 2-core machine (a barely warmed-up tiny model,
so nearly every answer is wrong: rewards -1.0 to -0.97; one step with tokens of its own version,
so one mismatch point at a ratio of 1.000001). `recorded/math_tiny_10_steps.jsonl.gz` is its
metrics.jsonl without the controller's admission and the reward service's records, floats cut
to 6 digits except in the trainer's step records. What the report draws and what `simulate --calibrate` fits are tested on it,
without starting a training run."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CONFIG = "configs/math-tiny.yaml"
OVERRIDES = ["trainer.total_steps=10", "rollout.eval_size=0", "rollout.eval_every=0", "experiment.trackers=[jsonl]"]
LAUNCH = {"time": 1795700548.296, "config": CONFIG, "commit": "0e65a8c6aa7fa880f2a4c437c92a26997275d979",
          "resume": False}


def write_recorded_run(exp: ExpDir) -> ExpDir:
    """The run's experiment directory as the launcher left it: metrics, resolved config, launch."""
    exp.root.mkdir(parents=True, exist_ok=True)
    exp.metrics.write_bytes(gzip.decompress((HERE / "recorded" / "math_tiny_10_steps.jsonl.gz").read_bytes()))
    save_resolved(load_config(REPO / CONFIG, [*OVERRIDES, f"experiment.exp_dir={exp.root}"]), exp.root)
    (exp.root / "launches.jsonl").write_text(json.dumps(LAUNCH) + "\n")
    return exp
