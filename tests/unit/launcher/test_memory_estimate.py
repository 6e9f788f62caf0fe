"""Shipped configs that fit: every one passes `tandem config check --skip-files` and `tandem plan`
with its per-GPU memory estimate, the cluster ones for 1.5B to 32B, math and code, each with a
held-out set and trackers; a micro-batch holds the longest sample; a config that does not fit
its GPUs is refused with the numbers (launcher/simulate/memory.py, docs/plan.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import ConfigError, load_config, longest_sequence
from tandem.launcher.plan import plan_for
from tandem.launcher.simulate.memory import estimate

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.yaml"))
GB = 1e9


@pytest.fixture(autouse=True)
def cluster_paths(monkeypatch, tmp_path):
    for var in ("TANDEM_MODELS", "TANDEM_DATA", "TANDEM_RUNS"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def _est(cfg):
    return estimate(cfg, plan_for(cfg, place_cpus=False).train_dp)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_the_check_and_the_plan_with_its_estimate(path, capsys):
    assert main(["config", "check", "--skip-files", str(path)]) == 0
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    assert cfg.trainer.max_tokens_per_mb >= longest_sequence(cfg.rollout)
    if cfg.gen.backend != "sglang":
        assert "Memory per GPU" not in out or "not estimated" in out
        return
    assert f"Memory per GPU (estimate, GB): {Path(cfg.experiment.model).name.removeprefix('DeepSeek-')}" in out
    trainer, gen = _est(cfg).roles
    assert {"weights", "gradients", "optimizer", "activations", "logits"} <= trainer.parts.keys()
    assert {"weights", "KV cache"} <= gen.parts.keys()
    assert trainer.fits and gen.fits and trainer.total <= 0.9 * 80 * GB
    assert out.count("yes") >= 2 and " NO " not in out
    # what a cluster run is watched with: a held-out set and trackers beside metrics.jsonl
    assert cfg.rollout.eval_dataset and cfg.rollout.eval_size > 0 and cfg.rollout.eval_every > 0
    assert {"tensorboard", "wandb"} <= set(cfg.experiment.trackers)


def test_the_cluster_configs_cover_every_size_for_math_and_code():
    shipped = set()
    for path in CONFIGS:
        cfg = load_config(path)
        if cfg.gen.backend == "sglang":
            shipped.add((cfg.reward.task, Path(cfg.experiment.model).name.rsplit("-", 1)[-1]))
    assert shipped >= {(task, size) for task in ("math", "code") for size in ("1.5B", "7B", "14B", "32B")}


def test_the_estimate_is_the_sum_of_the_documented_terms():
    """math-r1-1.5b's trainer rank, by hand: R1-Distill-Qwen-1.5B has P = 1,777,088,000 parameters
    (28 layers of 46,797,824, two 151,936 x 1,536 embeddings, the final norm); TP 1, DP 32, bf16;
    N = 34,816 tokens; recompute keeps 2 x 1,536 bytes per token and layer plus one whole layer of
    2 x (4h + 3h + 3kv + 4ffn) = 94,720 bytes per token; the logits of a 1,024-token chunk, 2 x 2 +
    20 bytes per token and vocabulary entry, plus 4 bf16 gradients of the 151,936 x 1,536 output
    layer."""
    trainer, gen = _est(load_config(CONFIGS[[p.name for p in CONFIGS].index("math-r1-1.5b.yaml")])).roles
    expect = {"weights": 3_554_176_000, "gradients": 7_108_352_000, "optimizer": 666_408_000,
              "activations": 6_292_504_576, "logits": 1024 * 151_936 * 24 + 4 * 2 * 151_936 * 1536}
    assert trainer.parts == pytest.approx(expect, rel=1e-12)
    # SGLang's pool: 0.8 x 80 GB less the bf16 weights; 28 layers x 2 KV heads x 128 x 2 (k, v) x 2 bytes
    assert gen.parts["KV cache"] == pytest.approx(0.8 * 80e9 - 3_554_176_000)
    assert gen.kv_needed == 34_816 * 28 * 2 * 128 * 2 * 2


def test_a_config_that_does_not_fit_is_refused_with_its_numbers(capsys):
    path = str(CONFIGS[[p.name for p in CONFIGS].index("math-r1-32b.yaml")])
    longer = ["rollout.max_new_tokens=32768", "trainer.max_tokens_per_mb=34816", "trainer.tensor_parallel=4"]
    assert main(["plan", path, *longer]) == 2
    err = capsys.readouterr().err
    assert "trainer rank (TP 4 x PP 1, DP 8) needs 90.4 GB of a H800's 80 GB (72 GB usable)" in err
    assert "weights 16.4, gradients 32.8, optimizer 12.3, activations 26.5, logits 2.5 GB" in err
    assert "trainer.max_tokens_per_mb" in err
    assert main(["config", "check", "--skip-files", path, *longer]) == 2   # what a launch checks first
    assert "does not fit the GPUs (simulate.hardware=H800)" in capsys.readouterr().err
    # without recompute the advice names it, and the activations are every layer's
    assert main(["plan", path, "trainer.megatron.recompute=false"]) == 2
    assert "set trainer.megatron.recompute: true" in capsys.readouterr().err


def test_pipeline_parallelism_counts_every_micro_batch_the_gpipe_schedule_keeps(capsys):
    """math-r1-7b at PP 2: a DP rank's minibatch is 512 / 4 groups x 16 samples x (512 + 4,096)
    tokens (the simulator's workload) / 8 ranks = 1,179,648 tokens: 34 micro-batches of 34,816,
    all alive until their backward, each keeping its layer inputs and its last hidden states."""
    path = str(CONFIGS[[p.name for p in CONFIGS].index("math-r1-7b.yaml")])
    cfg = load_config(path, ["trainer.pipeline_parallel=2"])
    (trainer, _), one = _est(cfg).roles, _est(load_config(path)).roles[0]
    assert any("34 micro-batches of a minibatch alive at once" in n for n in trainer.notes)
    per_token_layer_input = 2 * 3584 * 14            # bf16 hidden x the stage's 14 layers
    assert trainer.parts["activations"] == pytest.approx(
        34_816 * (14 * 2 * 3584 + 2 * (4 * 3584 + (3 * 3584 + 3 * 512 + 4 * 18944) / 2))
        + 33 * 34_816 * per_token_layer_input)
    assert trainer.parts["logits"] == pytest.approx(one.parts["logits"] + 33 * 34_816 * 3584 * 2)
    assert main(["plan", path, "trainer.pipeline_parallel=2"]) == 2
    assert "lower trainer.pipeline_parallel" in capsys.readouterr().err


def test_a_generation_server_without_room_for_one_sequence_is_refused(capsys):
    path = str(CONFIGS[[p.name for p in CONFIGS].index("math-r1-32b.yaml")])
    assert main(["plan", path, "gen.tp_size=1", "gen.mem_fraction_static=0.85"]) == 2
    err = capsys.readouterr().err
    assert "generation server GPU (TP 1): the KV cache (2.5 GB) does not hold one longest sequence (4.8 GB)" in err
    assert "raise gen.tp_size" in err


@pytest.mark.parametrize("workflow, need", [("tandem.rollout.workflow:single_turn", 2048 + 1024),
                                            ("tandem.rollout.code_feedback:code_with_feedback", 2048 + 3 * 1024)])
def test_a_micro_batch_smaller_than_the_longest_sample_is_refused_naming_both_keys(workflow, need):
    base = ["experiment.name=x", "experiment.model=m", f"rollout.workflow={workflow}", "rollout.max_turns=3",
            "rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=1024"]
    assert load_config(None, [*base, f"trainer.max_tokens_per_mb={need}"])
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"trainer.max_tokens_per_mb={need - 1}"])
    text = str(e.value)
    assert "trainer.max_tokens_per_mb" in text and "rollout.max_prompt_tokens" in text
    assert "rollout.max_new_tokens" in text and f"= {need}" in text


# R1-Distill-Qwen-1.5B's layer on the torch backend, bytes per token (launcher/simulate/memory.py's
# `_layer_activation_bytes`, counted tensor by tensor: tests/unit/trainer/test_recompute_torch_layers.py)
TORCH_LAYER = {"float32": 200_760, "bfloat16": 121_912}
# autocast's bf16 copies of one layer's weight matrices: its 46,797,824 parameters less the norms
# (2 x 1,536) and the q/k/v biases (1,536 + 2 x 256)
LAYER_COPIES = 2 * (46_797_824 - 5_120)


def test_bf16_products_shrink_the_torch_backends_activations_not_its_float32_state():
    """trainer.compute_dtype: bfloat16 (autocast) keeps the torch backend's weights, gradients and
    AdamW in float32, and its products' activations in bf16 (not all of them: the norms' float32
    copies stay), plus autocast's bf16 copies of every layer's weight matrices; the estimate says
    so term by term, and a torch backend in float32 that does not fit is told to set it."""
    path = CONFIGS[[p.name for p in CONFIGS].index("math-r1-1.5b.yaml")]
    fp32, bf16 = (_est(load_config(path, ["trainer.backend=torch", "trainer.recompute=false",
                                          f"trainer.compute_dtype={d}"])).roles[0] for d in ("float32", "bfloat16"))
    for k in ("weights", "gradients", "optimizer"):
        assert bf16.parts[k] == fp32.parts[k]
    n, layers = 34_816, 28
    assert fp32.parts["activations"] == n * layers * TORCH_LAYER["float32"]
    assert bf16.parts["activations"] == layers * (n * TORCH_LAYER["bfloat16"] + LAYER_COPIES)
    assert bf16.parts["logits"] < fp32.parts["logits"]
    assert "trainer.compute_dtype: bfloat16" in fp32.advice and "compute_dtype" not in bf16.advice


def test_the_torch_backends_recompute_keeps_a_layers_float32_input_and_auto_turns_it_on():
    """trainer.recompute on the torch backend: per token, every layer's input (the float32 residual
    stream of its replica: 4h, where Megatron's bf16 keeps 2h) plus one whole layer and its weight
    copies; a torch backend without it is told to set it, and auto (the default) sets it here,
    where the rank does not fit an H800 without it."""
    path = CONFIGS[[p.name for p in CONFIGS].index("math-r1-1.5b.yaml")]
    base = ["trainer.backend=torch", "trainer.compute_dtype=bfloat16"]
    off, on, auto = (_est(load_config(path, [*base, f"trainer.recompute={r}"])).roles[0]
                     for r in ("false", "true", "auto"))
    mega = _est(load_config(path)).roles[0]     # Megatron bf16 with recompute, TP 1
    n = 34_816
    assert on.parts["activations"] == n * (28 * 4 * 1536 + TORCH_LAYER["bfloat16"]) + LAYER_COPIES
    assert mega.parts["activations"] == n * (28 * 2 * 1536 + 94_720)
    assert on.parts["activations"] < off.parts["activations"] / 10
    assert "set trainer.recompute: true" in off.advice and "trainer.recompute" not in on.advice
    assert not off.fits and on.fits and auto.recompute.on and auto.parts == on.parts
    assert auto.recompute.without == off.total and auto.recompute.with_ == on.total
