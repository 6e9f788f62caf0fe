"""`tandem run` with `experiment.trackers: [jsonl, tensorboard, wandb]`: a short real run whose
trainer steps and held-out evaluations (before, during and after the run) are in the
TensorBoard event file under `<exp>/tb/` with the values metrics.jsonl holds, and whose offline
W&B run is under `<exp>/wandb/`."""
from __future__ import annotations

import importlib.util
import json

import pytest
from local_run import finish, leftovers, steps, tandem, write_config

from services.protocol import ExpDir

pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("tensorboard", "wandb")),
                                reason="pip install 'tandem[trackers]'")


def test_run_writes_tensorboard_and_offline_wandb(tmp_path, tiny_model_dir, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import history

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "tracked")
    out = finish(tandem("run", cfg, "experiment.trackers=[jsonl,tensorboard,wandb]", "trainer.total_steps=3",
                        "rollout.eval_size=4", "rollout.eval_every=1", "rollout.eval_every_size=4"))
    exp = ExpDir(tmp_path / "tracked")
    assert "step 3/3" in out, out[-3000:]
    assert f"tensorboard --logdir {exp.root / 'tb'}" in out and f"wandb sync {exp.root / 'wandb'}" in out

    trained = steps(exp)
    acc = EventAccumulator(str(exp.root / "tb"))
    acc.Reload()
    for name in ("loss", "reward_mean", "grad_norm", "step_s", "weight_sync_s"):
        assert [(e.step, e.value) for e in acc.Scalars(name)] == \
            [(r["step"], pytest.approx(r[name], rel=1e-6, abs=1e-30)) for r in trained], name
    # Everything was forwarded: the trainer's follower, then the launcher's last pass after the
    # evaluation of the trained policy; every held-out evaluation, before and after included.
    # (Services stopping after that pass may still append records no tracker shows.)
    offset = json.loads((exp.root / "trackers" / "offset.json").read_text())["offset"]
    records = [json.loads(line) for line in exp.metrics.read_bytes().splitlines()]
    forwarded = [json.loads(line) for line in exp.metrics.read_bytes()[:offset].splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals == [r for r in forwarded if r.get("event") == "eval"]
    assert {r.get("tag") for r in evals} >= {"before", "after"}
    assert [(e.step, e.value) for e in acc.Scalars("eval_accuracy")] == \
        [(r["step"], pytest.approx(r["eval_accuracy"])) for r in evals]

    # Two offline pieces of one W&B run: the trainer's, and the launcher's last pass (same run id).
    pieces = sorted((exp.root / "wandb").glob("offline-run-*"))
    assert len(pieces) == 2 and len({p.name.rsplit("-", 1)[1] for p in pieces}) == 1, pieces
    rows = [row for piece in pieces for row in history(next(piece.glob("run-*.wandb")))]
    assert [r["step"] for r in rows if "loss" in r] == [r["step"] for r in trained]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [r["step"] for r in evals]
    # No sink failed, and W&B printed nothing into the trainer's console log.
    trainer_log = (exp.logs / "trainer-0.log").read_text().splitlines()
    assert not [line for line in trainer_log if " WARNING " in line or " ERROR " in line or "wandb:" in line]
    assert leftovers(exp) == []
