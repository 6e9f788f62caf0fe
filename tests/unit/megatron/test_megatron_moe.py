"""Qwen3-MoE on the Megatron backend, in one process (real megatron-core 0.16.1 on CPU): the shape
read from config.json, exact HF -> Megatron -> HF round trips through tensor- and expert-parallel
shards, logits parity with transformers in float32 (both router conventions), the router losses'
gradients against a reference computed here, and the per-layer routing metrics against
transformers' own routing.

EP=2 against EP=1 in a real 2-process job: tests/integration/megatron/test_megatron_moe_parallel.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import megatron_case as mc
import megatron_moe_case as mm
import pytest
import torch

from tandem.trainer.megatron import convert, convert_moe
from tandem.trainer.megatron.shape import decoder_shape

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[bool, Path]:
    """norm_topk_prob -> a tiny Qwen3-MoE directory."""
    return {norm: mm.make_moe_dir(tmp_path_factory.mktemp(f"moe-norm{int(norm)}"), norm_topk_prob=norm)
            for norm in (True, False)}


def _hf(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(d / "model.safetensors"))


# ---- shape ----------------------------------------------------------------------------------------
def test_shape_reads_the_experts(moe_dirs):
    s = decoder_shape(moe_dirs[True])
    assert (s.model_type, s.is_moe, s.num_experts, s.moe_topk, s.moe_intermediate_size) == ("qwen3_moe", True, 4, 2, 32)
    assert (s.qk_norm, s.qkv_bias, s.head_dim, s.tie_word_embeddings, s.norm_topk_prob) == (True, False, 24, False, True)
    assert decoder_shape(moe_dirs[False]).norm_topk_prob is False
    assert not decoder_shape(mc.make_model_dir(moe_dirs[True].parent / "dense")).is_moe


@pytest.mark.parametrize(("changes", "message"), [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported.*every layer must be MoE"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
])
def test_dense_layers_among_moe_ones_are_refused(tmp_path, moe_dirs, changes, message):
    cfg = json.loads((moe_dirs[True] / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        decoder_shape(tmp_path)


def test_parallel_layouts_the_experts_cannot_take_are_refused(moe_dirs):
    from tandem.trainer.megatron.model import check_parallel_fits

    s = decoder_shape(moe_dirs[True])
    check_parallel_fits(s, tp=2, pp=2, ep=4)
    with pytest.raises(ValueError, match=r"trainer.expert_parallel=3 must divide num_experts=4"):
        check_parallel_fits(s, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match=r"trainer.tensor_parallel=3 must divide moe_intermediate_size=32"):
        check_parallel_fits(s, tp=3, pp=1, ep=1)
    dense = decoder_shape(mc.make_model_dir(moe_dirs[True].parent / "dense2"))
    with pytest.raises(ValueError, match=r"trainer.expert_parallel=2 needs a mixture-of-experts model"):
        check_parallel_fits(dense, tp=1, pp=1, ep=2)


def test_config_refuses_expert_parallel_where_it_cannot_run(tmp_path):
    from tandem.launcher.config import ConfigError, load_config

    exp = ["experiment.model=m", "experiment.name=x", f"experiment.exp_dir={tmp_path / 'x'}", "trainer.backend=megatron"]
    assert load_config(None, [*exp, "trainer.expert_parallel=2"]).trainer.expert_parallel == 2
    with pytest.raises(ConfigError, match=r"trainer\.expert_parallel: .*Megatron backend's; trainer\.backend is 'torch'"):
        load_config(None, [*exp, "trainer.expert_parallel=2", "trainer.backend=torch"])
    with pytest.raises(ConfigError, match=r"trainer\.megatron\.moe_token_dispatcher: 'allgather' needs equal token counts"):
        load_config(None, [*exp, "trainer.expert_parallel=2", "trainer.megatron.moe_token_dispatcher=allgather"])
    assert load_config(None, [*exp, "trainer.megatron.moe_token_dispatcher=allgather"]).trainer.expert_parallel == 1
    with pytest.raises(ConfigError, match=r"trainer\.megatron\.moe_z_loss_coeff: must be >= 0"):
        load_config(None, [*exp, "trainer.megatron.moe_z_loss_coeff=-1"])


# ---- conversion -----------------------------------------------------------------------------------
@pytest.mark.parametrize("te_norms", [False, True])
def test_round_trip_is_exact_through_tp2_and_ep2_shards(moe_dirs, te_norms):
    """HF -> Megatron -> (EP=2 x TP=2 shards -> merge) -> HF gives every tensor back, bit for bit."""
    hf, shape = _hf(moe_dirs[True]), decoder_shape(moe_dirs[True])
    mg = convert.hf_to_megatron(hf, shape, padded_vocab=64, te_norms=te_norms)
    # a MoE layer's MLP norm keeps its own name on both layer specs; the router is replicated
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mg and "decoder.layers.1.mlp.router.weight" in mg
    fc1 = mg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                       hf["model.layers.1.mlp.experts.3.up_proj.weight"]]))
    ep_parts = [convert_moe.ep_shard(mg, r, 2, shape.num_experts) for r in range(2)]
    assert torch.equal(ep_parts[1]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"], fc1)
    assert all(len([k for k in p if convert_moe.expert_index(k) is not None]) == 2 * 2 * 2 for p in ep_parts)
    merged_parts = []
    for part in ep_parts:
        merged = {}
        for name, t in part.items():
            shards = [convert.shard(name, t, r, 2) for r in range(2)]
            if convert_moe.expert_index(name) is not None:
                assert shards[0].shape[0 if name.endswith("fc1.weight") else 1] * 2 == t.shape[0 if name.endswith("fc1.weight") else 1]
            merged[name] = convert.merge(name, shards)
        merged_parts.append(merged)
    back = convert.megatron_to_hf(convert_moe.ep_merge(merged_parts), shape, te_norms=te_norms)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


# ---- in-process backends --------------------------------------------------------------------------
@pytest.fixture
def backend_of():
    """Builds an in-process TP=1 backend (model dir, trainer config); closes them after the test."""
    made = []

    def build(model_dir: Path, cfg=None):
        gen = mc.in_process_backend(model_dir, cfg=cfg or mm.moe_trainer_cfg())
        made.append(gen)
        return next(gen)
    yield build
    for gen in made:
        next(gen, None)


def _one_at_a_time(model_dir, cfg, fn):
    """`fn(backend)` with a backend of its own (Megatron's process groups: one per process)."""
    gen = mc.in_process_backend(model_dir, cfg=cfg)
    try:
        return fn(next(gen))
    finally:
        next(gen, None)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(moe_dirs, backend_of, norm_topk_prob):
    """float32 both sides, the dense families' tolerance, each sequence alone and packed: the router
    (top 2 of 4, renormalised or not), the experts and the probability-weighted sum as transformers."""
    from transformers import AutoModelForCausalLM

    backend = backend_of(moe_dirs[norm_topk_prob])
    hf = AutoModelForCausalLM.from_pretrained(moe_dirs[norm_topk_prob], dtype=torch.float32).eval()
    mb = mc.micro_batches()[0]
    refs = mc.assert_logits_match(backend, hf, mb)
    with torch.no_grad():
        packed = backend._logits(mb).cpu()
    torch.testing.assert_close(packed, torch.cat(refs), atol=2e-5, rtol=1e-5)


def _router_inputs(backend, mbs, loss_fn):
    """One update; the last layer's router inputs per micro-batch, and the gradients."""
    from tandem.trainer.megatron.moe import routers

    last = routers(backend._module())[-1]
    seen = []
    hook = last.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    try:
        backend.train_step(mbs, loss_fn, 1.0)
    finally:
        hook.remove()
    return seen, {n: p.grad.clone() for n, p in backend._module().named_parameters() if p.grad is not None}


def test_router_losses_add_their_gradient_token_weighted(moe_dirs):
    """The load-balancing loss E/(k T^2) sum_e P_e f_e and the z-loss mean(logsumexp^2), per micro-batch,
    weighted by its share of the update's tokens: their gradient on the last layer's router (reached
    by no other router loss) is what autograd gives for the same formulas here."""
    d, aux, z = moe_dirs[True], 0.3, 0.2
    mbs = mc.micro_batches(0) + mc.micro_batches(1)
    loss_fn = mc.make_loss_fn(mc.n_valid(mbs))
    # no clipping: the gradients read after the update would be scaled by the losses' own norm
    plain = _one_at_a_time(d, mm.moe_trainer_cfg(clip=0.0), lambda be: _router_inputs(be, mbs, loss_fn))
    with_losses = _one_at_a_time(d, mm.moe_trainer_cfg(aux=aux, z=z, clip=0.0), lambda be: _router_inputs(be, mbs, loss_fn))
    name = "decoder.layers.1.mlp.router.weight"
    weight = _hf(d)["model.layers.1.mlp.gate.weight"].clone().requires_grad_(True)
    n_all = sum(mb.n_tokens for mb in mbs)
    total = 0.0
    for x in with_losses[0]:
        logits = x @ weight.t()
        scores = torch.softmax(logits, dim=-1)
        counts = torch.zeros(mm.EXPERTS).scatter_add_(0, logits.topk(mm.TOPK, dim=-1).indices.reshape(-1),
                                                      torch.ones(x.shape[0] * mm.TOPK))
        t = x.shape[0]
        balance = mm.EXPERTS / (mm.TOPK * t * t) * (scores.sum(0) * counts).sum()
        zl = torch.logsumexp(logits, dim=-1).square().mean()
        total = total + t / n_all * (aux * balance + z * zl)
    total.backward()
    extra = with_losses[1][name] - plain[1][name]
    assert extra.abs().max() > 1e-4   # the losses are there
    torch.testing.assert_close(extra, weight.grad, atol=1e-6, rtol=1e-4)
    # the experts' own gradients do not see the router losses
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    torch.testing.assert_close(with_losses[1][expert], plain[1][expert], atol=1e-7, rtol=1e-6)


def _hf_counts(model_dir: Path, mbs) -> list[list[torch.Tensor]]:
    """transformers' routing: per micro-batch, per layer, the token count of each expert."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for mb in mbs:
        per_layer = [torch.zeros(mm.EXPERTS) for _ in range(2)]
        for s in range(mb.n_seqs):
            one = mc.one_sequence(mb, s)
            with torch.no_grad():
                logits = hf(input_ids=one.input_ids[None], output_router_logits=True).router_logits
            for layer, lg in enumerate(logits):
                idx = torch.softmax(lg.float(), -1).topk(mm.TOPK, dim=-1).indices.reshape(-1)
                per_layer[layer] += torch.bincount(idx, minlength=mm.EXPERTS).float()
        out.append(per_layer)
    return out


@pytest.mark.parametrize("capacity", [0.0, 0.5], ids=["dropless", "capacity-0.5"])
def test_routing_metrics_count_what_transformers_routes(moe_dirs, backend_of, capacity):
    """Per layer: the busiest expert's share times the experts (1 = even), and the assignments a
    capacity limit drops: each micro-batch keeps at most ceil(tokens x k / E x factor) per expert.
    transformers never drops, so with a capacity only the first layer's input is the same on both
    sides; the second layer is checked for what any routing must satisfy."""
    d = moe_dirs[True]
    mbs = mc.micro_batches(0) + mc.micro_batches(1)
    backend = backend_of(d, mm.moe_trainer_cfg(capacity=capacity))
    assert backend.step_metrics() == {}   # nothing routed for training yet
    backend.forward_logprobs(mbs[0], 1.0)   # a proximal pass is not counted
    backend.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    got = backend.step_metrics()
    counts = _hf_counts(d, mbs)
    wanted = sum(mb.n_tokens for mb in mbs) * mm.TOPK
    layers = 1 if capacity else 2
    for layer in range(layers):
        total = sum(c[layer] for c in counts)
        kept = total
        if capacity:
            kept = sum(torch.clamp(c[layer], max=math.ceil(mb.n_tokens * mm.TOPK / mm.EXPERTS * capacity))
                       for c, mb in zip(counts, mbs, strict=True))
        assert float(total.sum()) == wanted
        assert got[f"moe_l{layer}_load_max"] == pytest.approx(float(kept.max() / kept.sum() * mm.EXPERTS))
        assert got[f"moe_l{layer}_dropped"] == pytest.approx(float(1 - kept.sum() / total.sum()))
    assert 1.0 <= got["moe_l1_load_max"] <= mm.EXPERTS and 0.0 <= got["moe_l1_dropped"] < 1.0
    assert got["moe_dropped_fraction"] == pytest.approx((got["moe_l0_dropped"] + got["moe_l1_dropped"]) / 2)
    assert got["moe_load_max"] == max(got["moe_l0_load_max"], got["moe_l1_load_max"])
    assert (got["moe_l0_dropped"] > 0) is bool(capacity)
    assert backend.step_metrics() == {}   # taken: the next step starts from zero


def test_the_export_of_a_trained_moe_loads_in_transformers(moe_dirs, backend_of, tmp_path):
    """After an update on Megatron, the HF directory it writes (as a published version or `tandem
    export`) is one transformers loads, one tensor per expert as the Hub's, and its logits are the
    trained model's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    backend = backend_of(moe_dirs[True])
    mbs = mc.micro_batches(0)
    backend.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    backend.export_hf(tmp_path / "v1")
    written = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert sorted(written) == sorted(_hf(moe_dirs[True]))
    assert not torch.equal(written["model.layers.0.mlp.experts.1.down_proj.weight"],
                           _hf(moe_dirs[True])["model.layers.0.mlp.experts.1.down_proj.weight"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    mc.assert_logits_match(backend, hf, mc.micro_batches(1)[0])
