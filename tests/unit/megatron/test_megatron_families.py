"""Llama 3.x, Qwen3 and Mistral on the Megatron backend (Qwen2's cases are test_megatron_backend.py):
exact HF -> Megatron -> HF round trips (through TP=2 shards too), logits parity with transformers
in float32 (real megatron-core 0.16.1 on CPU, one rank), and the refusals of what the
conversion cannot carry, each naming its config.json field.

The 2-process TP=2 cases (Qwen3's q/k norm gradients summed over TP ranks) are in
tests/integration/megatron/test_megatron_families_tp2.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import megatron_case as mc
import megatron_families as mf
import pytest
import torch

from tandem.trainer.megatron import convert
from tandem.trainer.megatron.shape import decoder_shape

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    return {f: mf.make_family_dir(tmp_path_factory.mktemp(f), f) for f in mf.FAMILIES}


def _hf(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(d / "model.safetensors"))


# ---- shapes read from config.json ---------------------------------------------------------------
def test_shapes_carry_each_familys_switches(family_dirs):
    llama, qwen3, mistral = (decoder_shape(family_dirs[f]) for f in ("llama", "qwen3", "mistral"))
    assert (llama.qkv_bias, llama.qk_norm, llama.rope_scaling_factor, llama.tie_word_embeddings) == (False, False, 32.0, True)
    assert llama.rope_theta == 500000.0
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.rope_scaling_factor, qwen3.head_dim) == (False, True, None, 24)
    assert (mistral.qkv_bias, mistral.qk_norm, mistral.rope_scaling_factor, mistral.tie_word_embeddings) == (False, False, None, False)
    assert decoder_shape(mc.make_model_dir(family_dirs["llama"].parent / "qwen2")).qkv_bias


# ---- conversion (no process groups needed) ------------------------------------------------------
@pytest.mark.parametrize("family", mf.FAMILIES)
@pytest.mark.parametrize("te_norms", [False, True])
def test_round_trip_is_exact_through_tp2_shards(family_dirs, family, te_norms):
    """HF -> Megatron -> (TP=2 shards -> merge) -> HF gives every tensor back, same names, same bits."""
    hf = _hf(family_dirs[family])
    shape = decoder_shape(family_dirs[family])
    mg = convert.hf_to_megatron(hf, shape, padded_vocab=64, te_norms=te_norms)
    assert not any(k.endswith("linear_qkv.bias") for k in mg)   # no family here has a q/k/v bias
    has_qk_norm = any("q_layernorm" in k or "k_layernorm" in k for k in mg)
    assert has_qk_norm is (family == "qwen3")
    merged = {}
    for name, t in mg.items():
        parts = [convert.shard(name, t, r, 2) for r in range(2)]
        if convert.tp_layout(name)[0] is None:       # replicated (norms, q/k norms included)
            assert all(p is t for p in parts)
        else:
            assert parts[0].shape != t.shape
        merged[name] = convert.merge(name, parts)
    back = convert.megatron_to_hf(merged, shape, te_norms=te_norms)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qwen3_q_k_norms_and_head_dim_layout(family_dirs):
    """Query group 1 starts after group 0's two 24-wide query heads, its key and its value; the
    q/k norms are one [head_dim] weight each, under Megatron's `q_layernorm`/`k_layernorm`."""
    hf, shape = _hf(family_dirs["qwen3"]), decoder_shape(family_dirs["qwen3"])
    mg = convert.hf_to_megatron(hf, shape, padded_vocab=64)
    qkv = mg["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 + 2) * 24, 64)
    assert torch.equal(qkv[4 * 24], hf["model.layers.1.self_attn.q_proj.weight"][2 * 24])
    assert torch.equal(qkv[2 * 24], hf["model.layers.1.self_attn.k_proj.weight"][0])
    assert torch.equal(mg["decoder.layers.1.self_attention.q_layernorm.weight"], hf["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(mg["decoder.layers.1.self_attention.k_layernorm.weight"], hf["model.layers.1.self_attn.k_norm.weight"])
    assert mg["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (24,)


def test_export_refuses_names_the_family_does_not_have(family_dirs):
    """Unknown Megatron names still raise on export: a q/k/v bias or q/k norms where the family has none."""
    llama = decoder_shape(family_dirs["llama"])
    mg = convert.hf_to_megatron(_hf(family_dirs["llama"]), llama, padded_vocab=64)
    for extra in ("decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.self_attention.q_layernorm.weight"):
        with pytest.raises(KeyError, match="no HF name"):
            convert.megatron_to_hf(mg | {extra: torch.zeros(3)}, llama)


# ---- refusals -----------------------------------------------------------------------------------
def _with(tmp_path: Path, source: Path, **changes) -> Path:
    cfg = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = cfg[key] | value
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(("family", "changes", "message"), [
    ("mistral", {"sliding_window": 16}, r"sliding_window=16 is not supported.*max_position_embeddings=128"),
    ("mistral", {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
     r"model_type 'gemma2' is not supported.*supported: llama, mistral, qwen2, qwen3"),
    ("llama", {"rope_parameters": {"low_freq_factor": 2.0}}, r"rope_parameters\.low_freq_factor=2\.0.*hard-codes 1\.0"),
    ("llama", {"rope_parameters": {"original_max_position_embeddings": 4096}},
     r"rope_parameters\.original_max_position_embeddings=4096.*hard-codes 8192"),
    ("llama", {"attention_bias": True}, r"attention_bias=true is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_parameters\.rope_type 'yarn' for model_type 'qwen3'"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, r"use_sliding_window=true"),
    ("mistral", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"rope_type 'llama3' for model_type 'mistral'"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, family_dirs, family, changes, message):
    with pytest.raises(ValueError, match=message) as err:
        decoder_shape(_with(tmp_path, family_dirs[family], **changes))
    assert "config.json" in str(err.value)


def test_mistral_sliding_window_that_cannot_bite_is_accepted(tmp_path, family_dirs):
    assert decoder_shape(_with(tmp_path, family_dirs["mistral"], sliding_window=128)).max_position_embeddings == 128


# ---- logits parity (TP=1 in this process) ---------------------------------------------------------
@pytest.fixture
def backend_of(family_dirs):
    """Builds the in-process TP=1 backend of a family; closes it after the test, failed or not."""
    made = []

    def build(family: str):
        gen = mc.in_process_backend(family_dirs[family])
        made.append(gen)
        return next(gen)
    yield build
    for gen in made:
        next(gen, None)


@pytest.mark.parametrize("family", mf.FAMILIES)
def test_logits_match_transformers(family_dirs, backend_of, family):
    """float32 on both sides, as test_megatron_backend.py's Qwen2 case (same tolerance), on
    sequences up to 14 tokens, one sequence at a time and packed. For Llama the rotary
    frequencies themselves are compared too: megatron-core's llama3 scaling must give
    transformers' inverse frequencies (at these short positions the logits alone would barely
    tell a wrong scaling of the low frequencies)."""
    from transformers import AutoModelForCausalLM

    backend = backend_of(family)
    hf = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32).eval().to(backend.device)
    if family == "llama":
        got = backend._module().rotary_pos_emb.inv_freq.cpu()
        torch.testing.assert_close(got, hf.model.rotary_emb.inv_freq.cpu(), rtol=0, atol=0)
        assert not torch.allclose(got, 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    mb = mc.micro_batches()[0]
    refs = mc.assert_logits_match(backend, hf, mb)
    with torch.no_grad():
        packed = backend._logits(mb).cpu()
    torch.testing.assert_close(packed, torch.cat(refs), atol=2e-5, rtol=1e-5)
