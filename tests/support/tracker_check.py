"""What a run with `experiment.trackers: [jsonl, tensorboard, wandb]` must leave: the trainer's
steps and every held-out evaluation (before, during, after) in the TensorBoard event file under
`<exp>/tb/` with the values metrics.jsonl holds, the sample completions as text there and as
tables in the one offline W&B run under `<exp>/wandb/`.
Checked on an end-to-end run that has other things to prove too (one run, not two)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.services.protocol import ExpDir, read_metrics

INSTALLED = all(importlib.util.find_spec(p) is not None for p in ("tensorboard", "wandb"))
OVERRIDE = "experiment.trackers=[jsonl,tensorboard,wandb]"


def offline_wandb(monkeypatch, tmp_path) -> None:
    """No account, no network: W&B writes its run offline; its settings stay in tmp_path."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def assert_trackers_hold_the_run(exp: ExpDir, out: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_offline import history

    assert f"tensorboard --logdir {exp.root / 'tb'}" in out and f"wandb sync {exp.root / 'wandb'}" in out
    trained = read_metrics(exp, "trainer", "step")
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
    # The sample completions (trainer/samples.py): TensorBoard text and a W&B table at each of their steps.
    sampled = [r["step"] for r in records if r.get("event") == "samples"]
    assert [e.step for e in acc.Tensors("samples/text_summary")] == sampled
    assert [r["step"] for r in rows if r.get("samples/_type") == "table-file"] == sampled
    # No sink failed, and W&B printed nothing into the trainer's console log.
    trainer_log = (exp.logs / "trainer-0.log").read_text().splitlines()
    assert not [line for line in trainer_log if " WARNING " in line or " ERROR " in line or "wandb:" in line]
