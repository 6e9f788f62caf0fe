"""Activation recompute chosen by memory (`trainer.recompute: auto`, `trainer.megatron.recompute:
auto`; trainer/recompute.py), with the GPU's rule that memory is finite enforced on the CPU: a
stand-in capacity (TANDEM_DEVICE_MEMORY_BYTES) makes the trainer decide as on an 80 GB GPU, the
same way `tandem plan` shows for simulate.hardware: H100, from the one estimate both use
(launcher/simulate/memory.py). The torch backend's per-layer term is checked against what autograd
really keeps (tests/unit/trainer/test_recompute_torch_layers.py)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.launcher.cli import main
from tandem.launcher.config import load_config
from tandem.launcher.simulate.hardware import load_model_shape
from tandem.services.protocol import read_metrics
from tandem.trainer import recompute
from tandem.trainer.config import TrainerConfig

CONFIG = Path(__file__).parents[3] / "configs" / "math-r1-1.5b.yaml"
CPU = torch.device("cpu")
DP = 32   # the plan's data-parallel size for CONFIG (16 nodes x 8 GPUs at 3:1)


@pytest.fixture(autouse=True)
def cluster_paths(monkeypatch, tmp_path):
    for var in ("TANDEM_MODELS", "TANDEM_DATA", "TANDEM_RUNS"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv(recompute.ENV, raising=False)


@pytest.fixture(scope="module")
def qwen_1_5b(tmp_path_factory) -> Path:
    """Qwen2.5-1.5B's config.json (its published shape), without weights: all a decision reads."""
    m = load_model_shape("Qwen2.5-1.5B")
    out = tmp_path_factory.mktemp("qwen2.5-1.5b")
    (out / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": m.layers, "hidden_size": m.hidden, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "intermediate_size": m.intermediate, "vocab_size": m.vocab,
        "tie_word_embeddings": m.tied}))
    return out


def trainer_cfg(backend: str, pack: int) -> TrainerConfig:
    """What the cluster trains with: bf16 products on the torch backend, bf16 Megatron; auto."""
    return TrainerConfig(backend=backend, max_tokens_per_mb=pack, temperature=1.0, max_staleness=0,
                         overlong_max_len=pack, compute_dtype="bfloat16" if backend == "torch" else "float32")


def plan_overrides(backend: str, pack: int) -> list[str]:
    out = ["simulate.hardware=H100", "simulate.model_size=Qwen2.5-1.5B", f"trainer.max_tokens_per_mb={pack}",
           f"rollout.max_new_tokens={pack - 2048}", "trainer.megatron.recompute=auto"]
    if backend == "torch":
        out += ["trainer.backend=torch", "trainer.compute_dtype=bfloat16", "trainer.recompute=auto"]
    return out


@pytest.mark.parametrize("backend", ["torch", "megatron"])
@pytest.mark.parametrize("pack, on", [(32768, True), (8192, False)])
def test_auto_recomputes_a_32k_pack_of_the_1_5b_model_on_80_gb_not_an_8k_one(backend, pack, on, qwen_1_5b,
                                                                              monkeypatch, capsys):
    monkeypatch.setenv(recompute.ENV, "80e9")
    choice = recompute.decide(trainer_cfg(backend, pack), qwen_1_5b, DP, CPU, backend)
    assert choice.on is on and choice.setting == "auto" and choice.source == recompute.ENV
    assert choice.capacity == 80e9 and choice.usable == pytest.approx(72e9)
    assert (choice.without > choice.usable) is on and choice.with_ < choice.usable   # fits either way
    key = "trainer.recompute" if backend == "torch" else "trainer.megatron.recompute"
    assert choice.reason.startswith(f"{key}: auto -> {'on' if on else 'off'}: ")
    # tandem plan, for an H100 (80 GB), shows the same decision with the same two totals
    assert main(["plan", str(CONFIG), *plan_overrides(backend, pack)]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())   # the table's rows, one line each
    assert f"recompute {'on' if on else 'off'} (auto) -" in out
    assert f"total without {choice.without / 1e9:.1f} -" in out and f"total with {choice.with_ / 1e9:.1f} -" in out
    assert f"{key}: auto -> {'on' if on else 'off'}: {choice.without / 1e9:.1f} GB predicted without" in out


def test_without_a_stand_in_the_cpus_memory_is_not_finite_and_auto_is_off(qwen_1_5b):
    choice = recompute.decide(trainer_cfg("torch", 32768), qwen_1_5b, 1, CPU, "torch")
    assert choice.on is False and choice.capacity is None and choice.without > 100e9
    assert choice.reason.endswith("no finite device memory (the CPU)")


@pytest.mark.parametrize("setting", [True, False])
def test_true_and_false_stand_whatever_the_memory(setting, qwen_1_5b, monkeypatch):
    monkeypatch.setenv(recompute.ENV, "80e9")
    for pack in (8192, 32768):
        t = replace(trainer_cfg("megatron", pack), megatron=replace(trainer_cfg("megatron", pack).megatron,
                                                                    recompute=setting))
        assert recompute.decide(t, qwen_1_5b, DP, CPU, "megatron").on is setting


def test_the_setting_takes_true_false_or_auto_and_a_bad_stand_in_is_refused(qwen_1_5b, monkeypatch):
    assert load_config(str(CONFIG), ["trainer.megatron.recompute=auto"]).trainer.megatron.recompute == "auto"
    assert load_config(str(CONFIG), ["trainer.megatron.recompute=false"]).trainer.megatron.recompute is False
    bad = replace(trainer_cfg("torch", 8192), recompute="sometimes")
    assert ("recompute", "must be true, false or auto, got 'sometimes'") in bad.problems()
    # auto is the default on both backends, and the torch key's auto says nothing on Megatron
    assert not [p for p in trainer_cfg("megatron", 8192).problems() if p[0] == "recompute"]
    monkeypatch.setenv(recompute.ENV, "lots")
    with pytest.raises(ValueError, match=recompute.ENV):
        recompute.decide(trainer_cfg("torch", 8192), qwen_1_5b, 1, CPU, "torch")


def test_a_model_without_a_readable_shape_is_not_recomputed_by_auto_and_says_so(tmp_path, monkeypatch, caplog):
    """The torch backend runs any causal LM; one whose config.json the estimate cannot read keeps
    what it had before auto (off), with a warning naming the key; true still recomputes."""
    monkeypatch.setenv(recompute.ENV, "80e9")
    auto = recompute.decide(trainer_cfg("torch", 8192), tmp_path, 1, CPU, "torch")
    assert auto.on is False and auto.without is None and "no model shape" in auto.reason
    assert "trainer.recompute: auto cannot predict this model's memory" in caplog.text
    on = recompute.decide(replace(trainer_cfg("torch", 8192), recompute=True), tmp_path, 1, CPU, "torch")
    assert on.on is True and on.reason.startswith("trainer.recompute: true (no model shape")


def test_the_trainers_start_record_says_what_it_chose_and_why(exp, small_model_dir, monkeypatch):
    """Written by rank 0 before the trainer listens for trajectories (stopped there: the unit
    tier opens no socket)."""
    from types import SimpleNamespace

    from tandem.trainer import loop

    class Listening(Exception):
        pass

    def stop(*_):
        raise Listening

    monkeypatch.setattr(loop, "load_keys", stop)
    monkeypatch.setenv(recompute.ENV, "1e6")   # a 1 MB device: the tiny model's pack does not fit
    t = TrainerConfig(temperature=1.0, max_staleness=0, groups_per_step=4)
    cfg = SimpleNamespace(trainer=t, experiment=SimpleNamespace(model=str(small_model_dir), seed=0),
                          gen=SimpleNamespace(num_servers=1))
    with pytest.raises(Listening):
        loop.Trainer(cfg, exp)
    (rec,) = read_metrics(exp, "trainer", "trainer_start")
    r = rec["recompute"]
    assert rec["backend"] == "torch" and rec["world_size"] == 1 and rec["resumed"] is False
    assert r["setting"] == "auto" and r["on"] is True and r["capacity_bytes"] == 1e6 and r["source"] == recompute.ENV
    assert r["without_bytes"] > r["usable_bytes"] and r["reason"].startswith("trainer.recompute: auto -> on: ")
