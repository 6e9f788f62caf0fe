"""The CPU path's gradient reductions of the Megatron backend (on GPUs Megatron's DDP and
`finalize_model_grads` do them): what torch AdamW over each rank's shards needs before it steps.

- tied embeddings over pipeline stages: the first stage's embedding and the last stage's output
  copy are one parameter, their gradients summed over Megatron's embedding group;
- Qwen3's q/k norms over TP ranks: each rank normalises only its own heads with the shared weight;
- data parallel: dense gradients summed over data-parallel ranks, routed experts' over the ranks
  holding the same experts (moe_step.sum_grads);
- the global gradient norm, each tensor counted once whatever its sharding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.services.protocol import collectives
from tandem.trainer.megatron import convert, moe, moe_step


def sum_shared_embedding_grads(be) -> None:
    """Tied embeddings across stages: the first stage's embedding and the last stage's output
    copy are one parameter, so their gradients are summed (Megatron's embedding group)."""
    from megatron.core import parallel_state as ps

    if not ps.is_rank_in_embedding_group():
        return
    module = be._module()
    weight = module.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    collectives.all_reduce(weight.grad, group=ps.get_embedding_group())


def sum_qk_norm_grads_over_tp(be) -> None:
    """Qwen3's q/k norms: one weight, replicated, applied by each TP rank to its own heads
    only, so each rank's gradient is its heads' part; the sum over TP ranks is the gradient
    (what `finalize_model_grads` does on the GPU path for `qk_layernorm`)."""
    from megatron.core import parallel_state as ps

    norms = [p for n, p in be._module().named_parameters()
             if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in norms]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    for p, part in zip(norms, torch.split(flat, [p.numel() for p in norms]), strict=True):
        p.grad = part.view_as(p).clone()


def sum_grads_over_dp(be) -> None:
    """Dense gradients summed over data-parallel ranks, routed experts' over the ranks holding
    the same experts (moe_step.sum_grads)."""
    moe_step.sum_grads([(n, p) for n, p in be._module().named_parameters() if p.requires_grad])


def grad_norm(be) -> float:
    """L2 norm of the full gradient: shards summed over the model-parallel group, replicated
    tensors (norms) counted on TP rank 0 only. Which tensors are shards is decided by name
    (convert.tp_layout): Megatron's `tensor_model_parallel` attribute is not set on weights
    when `perform_initialization=False`."""
    from megatron.core import parallel_state as ps

    # The last stage's copy of a tied embedding is the first stage's parameter: count it once.
    skip = "output_layer.weight" if be.shape.tie_word_embeddings and not be.first_stage else None
    sq = torch.zeros((), dtype=torch.float64)
    named = list(be._module().named_parameters())
    for name, p in named:
        sharded = convert.tp_layout(name)[0] is not None
        if p.grad is not None and name != skip and (sharded or be.tp_rank == 0) and not moe.is_expert_param(name):
            sq += p.grad.double().pow(2).sum()
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group=group) > 1:
        collectives.all_reduce(sq, group=group)
    if be.shape.is_moe:   # routed experts: sharded over expert-parallel ranks too
        sq += moe_step.expert_grad_sq(named, convert.tp_layout)
    return float(sq.sqrt())
