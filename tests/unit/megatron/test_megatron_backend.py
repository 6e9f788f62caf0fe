"""Megatron-core backend in the pytest process: weight conversion, parity with transformers,
packing, export (real megatron-core 0.16.1 on CPU, one rank, TP=1).

The multi-process cases (TP=2, pipeline and data parallel, SIGKILL and resume) are in
tests/integration/megatron/test_megatron_parallel.py.
"""
from __future__ import annotations

from pathlib import Path

import megatron_case as mc
import pytest
import torch

from tandem.trainer.megatron import convert
from tandem.trainer.megatron.model import check_parallel_fits
from tandem.trainer.megatron.packing import block_diagonal_causal_mask, thd_packed_seq_params
from tandem.trainer.megatron.shape import decoder_shape

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return mc.make_model_dir(tmp_path_factory.mktemp("qwen2-tied"))


@pytest.fixture(scope="module")
def backend(model_dir):
    yield from mc.in_process_backend(model_dir)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---- conversion (no process groups needed) ------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_hf_megatron_hf_round_trip_is_exact(tmp_path, tied):
    from safetensors.torch import load_file

    d = mc.make_model_dir(tmp_path, tied=tied)
    hf = load_file(str(d / "model.safetensors"))
    shape = decoder_shape(d)
    mg = convert.hf_to_megatron(hf, shape, padded_vocab=64)
    assert mg["embedding.word_embeddings.weight"].shape[0] == 64
    assert ("output_layer.weight" in mg) is not tied
    # Query group 1's first query row sits after group 0's 2 query heads, its key and its value.
    hd = shape.head_dim
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.weight"][4 * hd],
                       hf["model.layers.0.self_attn.q_proj.weight"][2 * hd])
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.bias"][2 * hd],
                       hf["model.layers.0.self_attn.k_proj.bias"][0])
    back = convert.megatron_to_hf(mg, shape)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    # TP split then merge is the identity, and a rank's fc1 shard is [gate_r; up_r].
    for tp in (2, 4):
        for name, t in mg.items():
            assert torch.equal(convert.merge(name, [convert.shard(name, t, r, tp) for r in range(tp)]), t)
    fc1 = convert.shard("decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], 1, 2)
    assert torch.equal(fc1[:64], hf["model.layers.0.mlp.gate_proj.weight"][64:])
    assert torch.equal(fc1[64:], hf["model.layers.0.mlp.up_proj.weight"][64:])


def test_te_spec_norm_names_round_trip(model_dir):
    """The TransformerEngine (GPU) spec fuses norms into linear layers; names still round-trip."""
    from safetensors.torch import load_file

    hf = load_file(str(model_dir / "model.safetensors"))
    shape = decoder_shape(model_dir)
    mg = convert.hf_to_megatron(hf, shape, 64, te_norms=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in mg
    assert not any(k.endswith("input_layernorm.weight") for k in mg)
    back = convert.megatron_to_hf(mg, shape, te_norms=True)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_unsupported_checkpoints_are_named(tmp_path, model_dir):
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported"):
        decoder_shape(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        check_parallel_fits(decoder_shape(model_dir), tp=3, pp=1)


def test_block_diagonal_mask_and_thd_params():
    """The mask (the reference of VarlenCoreAttention's test) lets a token see only earlier
    tokens of its own sequence; the THD params are what both core attentions take."""
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    allowed = ~block_diagonal_causal_mask(cu)[0, 0]
    expect = torch.zeros(5, 5, dtype=torch.bool)
    expect[:2, :2] = torch.ones(2, 2).tril().bool()
    expect[2:, 2:] = torch.ones(3, 3).tril().bool()
    assert torch.equal(allowed, expect)
    p = thd_packed_seq_params(cu, "cpu")
    assert p.qkv_format == "thd" and p.max_seqlen_q == 3 and p.cu_seqlens_kv.tolist() == [0, 2, 5]


# ---- TP=1 in this process -------------------------------------------------------------------
def test_varlen_core_attention_equals_megatron_attention_under_the_block_diagonal_mask(backend):
    """Megatron's own DotProductAttention over the whole packed row under the block-diagonal mask
    (the local spec's path before issue 37) against VarlenCoreAttention one sequence at a time:
    the same outputs to float32 rounding, with the config's grouped-query heads."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from op_count import OpCount

    from tandem.trainer.megatron.varlen_attention import VarlenCoreAttention

    cfg = backend.config
    dense = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    varlen = VarlenCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    cu = torch.tensor([0, 3, 4, 11, 16], dtype=torch.int32)
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(16, n, d, generator=gen) for n in (heads, groups, groups)]
    q, k, v = (t.clone().requires_grad_(True) for t in base)
    with OpCount() as count:   # the sequences by one split: no row-sized zero gradient per sequence
        got = varlen(q, k, v, None, packed_seq_params=thd_packed_seq_params(cu, "cpu"))
        got.square().sum().backward()
    assert count.ops.get("slice_backward", 0) == 0, count.ops
    dq, dk, dv = (t.clone().requires_grad_(True) for t in base)
    want = dense(dq[:, None], dk[:, None], dv[:, None], block_diagonal_causal_mask(cu))   # [16, 1, heads * d]
    want.square().sum().backward()
    assert got.shape == (16, heads * d)
    torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-6)
    for mine, theirs in ((q, dq), (k, dk), (v, dv)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="THD"):
        varlen(q, k, v, None)


def test_logits_match_transformers(backend, model_dir):
    """float32 on both sides, on the backend's device (CUDA on a GPU), compared on the CPU."""
    mc.assert_logits_match(backend, _hf_model(model_dir).to(backend.device), mc.micro_batches()[0])


def test_packed_forward_equals_per_sequence(backend):
    """In float32 (the fixture's parameters, on a GPU too) packing is exact to rounding: a packing
    error (a token seeing another sequence, a wrong position) moves log-probs by O(0.1-1), far
    outside 2e-6. In bf16 the same comparison differs by up to a few bf16 steps of the logits
    (0.044 was measured on an H200: logits of magnitude ~4 have a bf16 step of 2^-6 = 0.016),
    because packed and per-sequence forwards round different matmul shapes; that is not a
    packing error, and it is not what this test is for."""
    for mb in mc.micro_batches(seed=3):
        packed = backend.forward_logprobs(mb, 0.7, with_entropy=True)
        parts = [backend.forward_logprobs(mc.one_sequence(mb, s), 0.7, with_entropy=True) for s in range(mb.n_seqs)]
        torch.testing.assert_close(packed.logp, torch.cat([p.logp for p in parts]), atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(packed.entropy, torch.cat([p.entropy for p in parts]), atol=2e-6, rtol=1e-6)
        assert (packed.logp[mb.cu_seqlens[:-1].long()] == 0).all()


def test_export_hf_is_exact_and_loads(backend, model_dir, tmp_path):
    """Export writes the fp32 weights training holds: the parameters here (float32), the
    optimizer's fp32 main copies when parameters are bf16 on a GPU (those are loaded from the
    checkpoint's own values and are exact at version 0 too: test_megatron_gpu_checkpoint.py)."""
    from safetensors.torch import load_file

    backend.export_hf(tmp_path / "out")
    hf = _hf_model(tmp_path / "out")
    original = load_file(str(model_dir / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert hf.model.embed_tokens.weight.shape[0] == mc.VOCAB


def test_a_non_finite_loss_term_refuses_the_update(backend):
    """The same loss (trainer/loss.py) and the same refusal (trainer/backend.py agreed_nonfinite)
    as the torch backend: a NaN advantage in one micro-batch names the policy term, and no
    parameter moves (Megatron's bf16 optimizer, with no loss scaler, would otherwise apply it)."""
    from tandem.trainer.loss import PPOSettings, ppo_token_loss

    mbs = mc.micro_batches(seed=5)
    total = mc.n_valid(mbs)
    before, updates = mc.logps(backend, mbs), backend.updates

    def loss_fn(mb, out):
        adv = mb.fields["adv"].clone()
        if torch.equal(mb.input_ids, mbs[0].input_ids):
            adv[1] = float("nan")
        logp = out.logp
        return ppo_token_loss(logp, logp.detach(), None, adv, mb.fields["loss_mask"],
                              PPOSettings(proximal="behaviour"), total)
    res = backend.train_step(mbs, loss_fn, 1.0)
    assert not res.applied and res.nonfinite == {"policy": 1}
    assert backend.updates == updates
    assert torch.equal(mc.logps(backend, mbs), before)
