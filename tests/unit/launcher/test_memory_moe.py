"""Mixture-of-experts models in `tandem plan` (launcher/simulate/memory.py, hardware.py): every
parameter, active or not, counts for memory and weight sync, the ones a token goes through for
compute; a trainer rank holds its 1/EP of the experts, their optimizer state over the ranks
holding the same experts; an expert-parallel size that does not divide data parallelism is
refused. The shipped Qwen3-30B-A3B config passes the plan with the other shipped configs
(test_memory_estimate.py); its numbers are checked here by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.launcher.config import load_config
from tandem.launcher.plan import PlanError, make_plan, plan_for
from tandem.launcher.simulate.hardware import load_model_shape
from tandem.launcher.simulate.memory import estimate

CONFIG = Path(__file__).parents[3] / "configs" / "math-qwen3-30b-a3b.yaml"
# Qwen3-30B-A3B by hand: attention 2048 x 4096 (q) + 2 x 2048 x 512 (k, v) + 4096 x 2048 (o),
# norms 2 x 2048 + 2 x 128 (q/k norms), router 128 x 2048; 128 experts of 3 x 2048 x 768.
DENSE_LAYER = 18_874_368 + 4_352 + 262_144
EXPERTS_LAYER = 128 * 3 * 2048 * 768
EMB = 151_936 * 2048


@pytest.fixture(autouse=True)
def cluster_paths(monkeypatch, tmp_path):
    for var in ("TANDEM_MODELS", "TANDEM_DATA", "TANDEM_RUNS"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def test_total_parameters_for_memory_active_ones_for_compute():
    m = load_model_shape("Qwen3-30B-A3B")
    assert m.params == 48 * (DENSE_LAYER + EXPERTS_LAYER) + 2 * EMB + 2048 == 30_532_122_624   # "30.5B"
    assert m.weight_bytes == 2 * m.params
    active = 48 * (DENSE_LAYER + 8 * 3 * 2048 * 768)
    assert m.matmul_params == active + EMB   # every weight but the embedding lookup, 8 of 128 experts
    assert 3.3e9 < active + 2 * EMB < 3.4e9   # "A3B": 3.3B activated parameters


def test_the_trainer_rank_holds_its_share_of_the_experts():
    cfg = load_config(CONFIG)
    plan = plan_for(cfg, place_cpus=False)
    assert (plan.train_gpus, plan.train_dp, plan.train_ep) == (16, 16, 8)
    trainer, gen = estimate(cfg, plan.train_dp).roles
    rank = 48 * DENSE_LAYER + 48 * EXPERTS_LAYER // 8 + 2 * EMB + 2048   # TP 1, EP 8
    assert trainer.parts["weights"] == 2 * rank and trainer.parts["gradients"] == 4 * rank
    # Adam over 16 data-parallel ranks for the dense part, over the 2 holding each expert for the rest
    assert trainer.parts["optimizer"] == pytest.approx(12 * ((rank - 48 * EXPERTS_LAYER // 8) / 16
                                                             + 48 * EXPERTS_LAYER / 8 / 2))
    assert gen.parts["weights"] == 2 * 30_532_122_624 / 2   # every expert on each server (TP 2)
    assert trainer.fits and gen.fits and "EP 8" in trainer.role


def test_three_to_one_does_not_fit_and_says_why():
    """With 8 trainer GPUs each holds 3.6B expert parameters whose Adam state no other rank shares."""
    from tandem.launcher.simulate.memory import refusal

    cfg = load_config(CONFIG, ["launcher.gen_train_ratio=3:1"])
    message = refusal(estimate(cfg, plan_for(cfg, place_cpus=False).train_dp))
    assert message is not None and "trainer rank (TP 1 x PP 1, DP 8, EP 8) needs 89." in message
    assert "optimizer 45.8" in message and "raise trainer.expert_parallel" in message


def test_expert_parallel_must_divide_data_parallel():
    assert make_plan(2, 8, "1:1", train_tp=2, train_ep=4).train_dp == 4
    with pytest.raises(PlanError, match=r"trainer.expert_parallel=3 must divide the trainer's data-parallel size 4"):
        make_plan(2, 8, "1:1", train_tp=2, train_ep=3)


def test_a_moe_config_json_gives_its_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96, "vocab_size": 61,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    m = load_model_shape("", str(tmp_path))
    assert (m.experts, m.experts_per_token, m.moe_intermediate, m.qk_norm, m.qkv_bias) == (4, 2, 32, True, False)
    assert m.layer_params - m.active_layer_params == 2 * 3 * 64 * 32   # the two experts a token skips


def test_the_shape_counts_a_moe_checkpoints_parameters(tmp_path):
    """The tiny Qwen3-MoE transformers builds: every parameter (router, all experts) counted."""
    import megatron_moe_case as mm
    from transformers import AutoModelForCausalLM

    d = mm.make_moe_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d)
    shape = load_model_shape("", str(d))
    assert shape.params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert shape.layers * shape.expert_layer_params == experts
