"""What a training update of a mixture-of-experts model needs beyond a dense one, on the Megatron
backend: every expert-parallel rank in step, the router losses switched on and scaled, and the
gradients reduced over the right groups.

- In step: a MoE layer's forward and backward are collectives over the expert-parallel group (the
  token dispatcher's all-to-all), so every rank of that group must run the same number of
  forwards. A rank with an empty micro-batch (fewer sequences than micro-batches) runs a
  one-token `phantom` instead, whose loss is zero and whose router adds no loss, so it changes no
  gradient.
- Router losses: megatron-core attaches them only while a router's `training` flag is set (the
  backend keeps every layer in eval mode, see backend.py); the flag is set on the routers alone,
  for the update's forwards, with the backward scale moe.py explains.
- Tensor parallelism without sequence parallelism: every TP rank routes all of the replica's tokens,
  and megatron-core's dispatcher gathers each TP rank's copy of them for every expert shard
  (written for sequence parallelism, where the copies are different tokens). The forward is
  right (each rank gets back its own copy's output), but each expert shard's weight gradient
  sums the gradient of every rank's copy of the loss: TP times the gradient. `undo_tp_copies`
  divides it back (on GPUs in DDP's `main_grad` buffers, before they are reduced); a test takes
  the TP=2 step against one rank's.
- Gradients (CPU path; on GPUs Megatron's DDP and `finalize_model_grads` do the same): a dense
  parameter's gradient is summed over data-parallel ranks, a routed expert's over the expert-data-
  parallel ranks that hold the same experts (its expert-parallel peers hold other experts), and
  the gradient norm adds the expert part over the expert-model-parallel group.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tandem.services.protocol import collectives
from tandem.trainer.backend import PackedBatch
from tandem.trainer.megatron import moe


def phantom_batch(device: torch.device) -> PackedBatch:
    """One token (id 0) of one sequence: a forward that only keeps the collectives in step."""
    return PackedBatch(torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device),
                       torch.tensor([0, 1], dtype=torch.int32), fields={"phantom": torch.ones(1)})


def is_phantom(mb: PackedBatch) -> bool:
    return "phantom" in mb.fields


def in_step(mbs: list[PackedBatch], ep_size: int, device: torch.device) -> list[PackedBatch]:
    """The micro-batches a rank runs: without expert parallelism the non-empty ones, with it every
    one (the loop gives each data-parallel rank the same count), empty ones as phantoms."""
    if ep_size == 1:
        return [mb for mb in mbs if mb.n_tokens]
    return [mb if mb.n_tokens else phantom_batch(device) for mb in mbs]


def global_tokens(mbs: list[PackedBatch]) -> float:
    """Tokens of this update over every data-parallel rank (the router losses' denominator)."""
    from megatron.core import parallel_state as ps

    n = torch.tensor([float(sum(mb.n_tokens for mb in mbs if not is_phantom(mb)))], dtype=torch.float64)
    group = ps.get_data_parallel_group()
    if dist.get_world_size(group=group) > 1:
        collectives.all_reduce(n, group=group)
    return float(n[0])


@contextlib.contextmanager
def training_routers(module, mcfg, stats: moe.RouterStats | None, n_tokens: float, device: torch.device):
    """Scope of an update's forwards and backwards: routing counted, router losses attached."""
    routers = moe.routers(module) if moe.router_losses_on(mcfg) else []
    if routers:
        moe.set_router_loss_scale(1.0 / max(n_tokens, 1.0), device)
    for r in routers:
        r.training = True
    if stats is not None:
        stats.active = True
    try:
        yield
    finally:
        for r in routers:
            r.training = False
        if stats is not None:
            stats.active = False


@contextlib.contextmanager
def without_router_losses(module, stats: moe.RouterStats | None = None):
    """A phantom's forward: no router loss attached, no routing counted."""
    routers = moe.routers(module)
    flags = [r.training for r in routers]
    active = stats is not None and stats.active
    for r in routers:
        r.training = False
    if stats is not None:
        stats.active = False
    try:
        yield
    finally:
        for r, flag in zip(routers, flags, strict=True):
            r.training = flag
        if stats is not None:
            stats.active = active


def undo_tp_copies(named_params, tp: int) -> None:
    """Routed experts' gradients divided by TP (see the module doc); nothing at TP = 1."""
    if tp == 1:
        return
    for name, p in named_params:
        if not moe.is_expert_param(name):
            continue
        grad = getattr(p, "main_grad", None)   # Megatron DDP's float32 buffer (GPU path)
        grad = grad if grad is not None else p.grad
        if grad is not None:
            grad.div_(tp)


def sum_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Data-parallel gradient sums: dense parameters over the data-parallel group, routed experts
    over the expert-data-parallel group (one all-reduce each, skipped for a group of one)."""
    from megatron.core import parallel_state as ps

    dense = [p for n, p in named_params if not moe.is_expert_param(n)]
    experts = [p for n, p in named_params if moe.is_expert_param(n)]
    for params, group in ((dense, ps.get_data_parallel_group()),
                          (experts, ps.get_expert_data_parallel_group())):
        if not params or dist.get_world_size(group=group) == 1:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(flat, group=group)
        for p, part in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
            p.grad = part.view_as(p).clone()


def expert_grad_sq(named_params, tp_layout) -> torch.Tensor:
    """The squared norm of the routed experts' gradients over the whole model (this rank's experts
    summed over the expert tensor x expert x pipeline group): every expert tensor is a TP shard."""
    from megatron.core import parallel_state as ps

    sq = torch.zeros((), dtype=torch.float64)
    for name, p in named_params:
        if moe.is_expert_param(name) and p.grad is not None:
            assert tp_layout(name)[0] is not None, name
            sq += p.grad.double().pow(2).sum()
    group = ps.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_world_size(group=group) > 1:
        collectives.all_reduce(sq, group=group)
    return sq


def routing_metrics(stats: moe.RouterStats, tp_rank: int) -> dict[str, float]:
    """Collective over the whole trainer world: the step's routing counts of every rank that routed
    distinct tokens (TP rank 0 of each replica; pipeline stages hold different layers), as metrics."""
    counts = stats.take()
    flat = torch.cat([counts.routed.reshape(-1), counts.wanted])
    if tp_rank != 0:
        flat.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(flat)
    layers, experts = counts.routed.shape
    return moe.routing_metrics(moe.RoutingCounts(flat[: layers * experts].view(layers, experts),
                                                 flat[layers * experts:]))


def agreement_metric(replay, tp_rank: int) -> dict[str, float]:
    """Collective over the whole trainer world: `moe_router_agreement`, the fraction of recorded
    token-layer top-k sets the routers chose themselves (trainer/routing_replay.py), over the ranks
    that routed distinct tokens (TP rank 0 of each replica; stages hold different layers)."""
    counts = torch.tensor(replay.take_agreement(), dtype=torch.float64)
    if tp_rank != 0:
        counts.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(counts)
    agreeing, compared = counts.tolist()
    return {"moe_router_agreement": agreeing / compared} if compared else {}
