"""Rollout routing replay on the torch backend (trainer/routing_replay.py): a Qwen3-MoE "sampler"
whose routers differ from the trainer's (perturbed router weights) records its experts as the
embedded server does; with trainer.routing_replay the trainer's routers use exactly those experts
at every recorded position (100%), its log-probs come closer to the sampler's (k3 mismatch), the
router still gets gradients, and packed and per-sequence forwards agree; the agreement metric
counts how often the trainer's own routers chose the sampler's experts (with replay on, given the
replayed layers below); without routes in the micro-batch the routers are the model's own."""
from __future__ import annotations

import copy

import megatron_case as mc
import megatron_moe_case as mm
import pytest
import torch

from tandem.rollout.server.routed_experts import RoutingCapture
from tandem.trainer.config import TrainerConfig
from tandem.trainer.routing_replay import routers
from tandem.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return mm.make_moe_dir(tmp_path_factory.mktemp("qwen3moe-r3"))


def _cfg(**kw) -> TrainerConfig:
    c = TrainerConfig(temperature=1.0, max_staleness=0, **kw)
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 0
    return c


def _sampler(moe_dir, noise: float = 0.01):
    """The trainer's model with its routers' weights perturbed: another routing of some tokens."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(noise * torch.randn(r.weight.shape, generator=gen))
    return model


def _recorded(sampler, mbs):
    """Each micro-batch with the sampler's routes ([tokens, layers, k], -1 on each sequence's last
    token, as the trajectory's rows are laid out) and its log-probs of the tokens."""
    cap = RoutingCapture(sampler)
    out, sampler_logp = [], []
    for mb in mbs:
        rows, lps = [], []
        cu = mb.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            ids = mb.input_ids[a:b]
            with torch.no_grad():
                logits = sampler(input_ids=ids[None]).logits[0]
            r = cap.take()
            r[-1] = -1
            rows.append(r)
            lp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]
            lps.append(torch.cat([torch.zeros(1), lp]))
        m = copy.copy(mb)
        m.fields = {**mb.fields, "routed_experts": torch.cat(rows).to(torch.int16)}
        out.append(m)
        sampler_logp.append(torch.cat(lps))
    cap.remove()
    return out, sampler_logp


def _used_routes(be, fn):
    """The expert ids the backend's routers actually chose during `fn()`: [tokens, layers, k]."""
    seen = [[] for _ in routers(be.model)]
    hooks = [r.register_forward_hook(lambda m, i, o, k=k: seen[k].append(o[2])) for k, r in enumerate(routers(be.model))]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([torch.cat(s) for s in seen], 1)


def _k3(logp, ref, mb):
    """docs/algorithms.md's k3 estimate of KL(sampler || trainer) over the scored tokens."""
    keep = mb.fields["loss_mask"]
    d = (logp - ref)[keep]
    return float((torch.exp(d) - 1 - d).mean())


def test_replay_routes_every_recorded_position_as_the_sampler_did(moe_dir):
    mbs, sampler_lp = _recorded(_sampler(moe_dir), mc.micro_batches(0) + mc.micro_batches(1))
    on = TorchBackend(_cfg(routing_replay=True), moe_dir, seed=0)
    off = TorchBackend(_cfg(), moe_dir, seed=0)
    k3 = {}
    for name, be in (("on", on), ("off", off)):
        logps = []
        used = _used_routes(be, lambda be=be, logps=logps: logps.extend(be.forward_logprobs(mb, 1.0).logp for mb in mbs))
        recorded = torch.cat([mb.fields["routed_experts"] for mb in mbs]).long()
        given = recorded[:, 0, 0] >= 0
        same = (used.sort(-1).values == recorded.sort(-1).values).all(-1)[given]
        if name == "on":
            assert bool(same.all()), "a replayed position went to other experts"
        else:
            assert not bool(same.all()), "the perturbed sampler routed every token as the trainer: no test"
        agreement = be.step_metrics()["moe_router_agreement"]
        assert 0.6 < agreement < 1.0, agreement
        k3[name] = sum(_k3(lp, s, mb) for lp, s, mb in zip(logps, sampler_lp, mbs, strict=True))
        k3[name + "_agreement"] = agreement
    assert k3["on"] < 0.5 * k3["off"], k3
    assert off.step_metrics() == {}                        # read once per step


def test_replay_keeps_router_gradients_and_packing_does_not_matter(moe_dir):
    mbs, _ = _recorded(_sampler(moe_dir), mc.micro_batches(1))
    packed = TorchBackend(_cfg(routing_replay=True), moe_dir, seed=0)
    per_seq = TorchBackend(_cfg(routing_replay=True, packed_forward=False), moe_dir, seed=0)
    torch.testing.assert_close(torch.cat([packed.forward_logprobs(mb, 1.0).logp for mb in mbs]),
                               torch.cat([per_seq.forward_logprobs(mb, 1.0).logp for mb in mbs]), atol=1e-5, rtol=1e-5)
    before = {n: p.detach().clone() for n, p in packed.model.named_parameters()}
    r = packed.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    assert r.applied
    moved = {n for n, p in packed.model.named_parameters() if not torch.equal(p, before[n])}
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= moved


def test_without_routes_the_routers_are_the_models_own(moe_dir):
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    be = TorchBackend(_cfg(routing_replay=True, packed_forward=False), moe_dir, seed=0)
    mb = mc.micro_batches(2)[0]
    ids = mb.input_ids[: mb.seqlens()[0]]
    with torch.no_grad():
        want = plain(input_ids=ids[None]).logits[0]
        got = be.model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="router saw"):
        be.routing.set_routes(torch.zeros(ids.numel() + 1, 2, mm.TOPK, dtype=torch.long))
        with torch.no_grad():
            be.model(input_ids=ids[None])


def test_the_megatron_backend_replays_the_same_routes(moe_dir):
    """megatron-core's TopKRouter through its router_replay hook (trainer/megatron/moe_replay.py):
    every recorded position goes to the recorded experts and the log-probs equal the torch
    backend's replayed ones (two implementations of one replayed model); its agreement metric
    equals the torch backend's."""
    from dataclasses import replace

    from tandem.trainer.megatron import moe as mg_moe
    mbs, _ = _recorded(_sampler(moe_dir), mc.micro_batches(0) + mc.micro_batches(1))
    torch_be = TorchBackend(_cfg(routing_replay=True), moe_dir, seed=0)
    want = torch.cat([torch_be.forward_logprobs(mb, 1.0).logp for mb in mbs])
    gen = mc.in_process_backend(moe_dir, cfg=replace(mm.moe_trainer_cfg(), routing_replay=True))
    try:
        be = next(gen)
        seen = [[] for _ in mg_moe.routers(be._module())]
        hooks = [r.register_forward_hook(lambda m, i, o, k=k: seen[k].append(o[1])) for k, r in
                 enumerate(mg_moe.routers(be._module()))]
        got = torch.cat([be.forward_logprobs(mb, 1.0).logp for mb in mbs])
        for h in hooks:
            h.remove()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        recorded = torch.cat([mb.fields["routed_experts"] for mb in mbs]).long()
        given = recorded[:, 0, 0] >= 0
        for layer, maps in enumerate(seen):        # routing maps [tokens, experts]
            chosen = torch.cat(maps)[given]
            want_map = torch.zeros_like(chosen).scatter(1, recorded[given][:, layer], True)
            assert torch.equal(chosen, want_map), layer
        assert be.step_metrics()["moe_router_agreement"] == torch_be.step_metrics()["moe_router_agreement"]
    finally:
        next(gen, None)


def test_the_megatron_hook_has_megatron_cores_signature():
    """moe_utils.compute_topk calls `router_replay.get_replay_topk(scores, topk, num_groups,
    group_topk, _compute_topk)`: the stand-in takes what megatron-core 0.16.1's RouterReplay takes."""
    import inspect

    from megatron.core.transformer.moe.router_replay import RouterReplay as CoreReplay

    from tandem.trainer.megatron.moe_replay import _LayerReplay
    assert (list(inspect.signature(_LayerReplay.get_replay_topk).parameters)
            == list(inspect.signature(CoreReplay.get_replay_topk).parameters))


def _replayed_update(be, mbs) -> dict[str, torch.Tensor]:
    """The gradients of one update of `be` on the replayed micro-batches."""
    grads, step = {}, be.optimizer.step
    module = be._module() if hasattr(be, "_module") else be.model

    def record_then_step(*a, **k):
        grads.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        return step(*a, **k)
    be.optimizer.step = record_then_step
    assert be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0).applied
    return grads


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_recomputing_backward_replays_its_micro_batchs_routes(moe_dir, backend):
    """With activation recompute the backward re-runs each layer's router: it must route by the
    routes of the micro-batch whose forward it repeats (the routes kept per layer), so the update
    equals the one without recompute."""
    from dataclasses import replace
    mbs, _ = _recorded(_sampler(moe_dir), mc.micro_batches(0) + mc.micro_batches(1))
    grads = []
    for recompute in (False, True):
        if backend == "torch":
            be = TorchBackend(_cfg(routing_replay=True, recompute=recompute), moe_dir, seed=0)
            grads.append(_replayed_update(be, mbs))
            continue
        cfg = mm.moe_trainer_cfg()
        cfg = replace(cfg, routing_replay=True, megatron=replace(cfg.megatron, recompute=recompute))
        gen = mc.in_process_backend(moe_dir, cfg=cfg)
        try:
            grads.append(_replayed_update(next(gen), mbs))
        finally:
            next(gen, None)
    assert grads[0].keys() == grads[1].keys()
    for k, v in grads[0].items():
        torch.testing.assert_close(grads[1][k], v, rtol=1e-5, atol=1e-6 * float(v.abs().max()) + 1e-12, msg=k)


def test_recompute_takes_each_micro_batchs_routes_when_the_backwards_run_later(moe_dir):
    """A pipeline stage runs every micro-batch's forward, then the backwards in reverse order
    (trainer/megatron/pipeline.py): the recomputed forwards must pop their own micro-batch's routes,
    not route by the last one set. Run that order on the torch backend's recomputing layers."""
    mbs, _ = _recorded(_sampler(moe_dir), mc.micro_batches(0) + mc.micro_batches(1))
    grads = []
    for recompute in (False, True):
        be = TorchBackend(_cfg(routing_replay=True, recompute=recompute), moe_dir, seed=0)
        be.routing.clear_stacks()
        losses = [-(be._forward(mb, 1.0, False).logp * mb.fields["loss_mask"]).sum() for mb in mbs]
        for loss in reversed(losses):
            loss.backward()
        assert not any(be.routing._stacks.values())        # every kept route was taken back
        grads.append({n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None})
    for k, v in grads[0].items():
        torch.testing.assert_close(grads[1][k], v, rtol=1e-5, atol=1e-6 * float(v.abs().max()) + 1e-12, msg=k)
