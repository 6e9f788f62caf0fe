"""Mixture-of-experts layers on the Megatron backend (Qwen3-MoE): megatron-core's `MoELayer` set up
as the checkpoint routes, its optional router losses scaled as the policy loss is, and the
per-layer routing statistics the trainer logs each step.

Routing (checked against transformers' `Qwen3MoeTopKRouter` and megatron-core 0.16.1's
`topk_routing_with_score_function`): Qwen3-MoE takes a float32 softmax over all experts, keeps the
k largest and, with `norm_topk_prob`, divides them by their sum. A softmax over the k largest
logits is the same numbers, which is megatron-core's `moe_router_pre_softmax=False`; without
`norm_topk_prob` it is the top k of the full softmax (`moe_router_pre_softmax=True`). The router
runs in float32 (`moe_router_dtype`), as Qwen3-MoE's softmax does, whatever `params_dtype` is.

Experts are megatron-core's `SequentialMLP` (one MLP per local expert) on both layer specs, so the
weight names are the same on CPU and GPU (`mlp.experts.local_experts.<i>.linear_fc1/2.weight`, i
local to the expert-parallel rank). TransformerEngine's grouped GEMM (`moe_grouped_gemm`) is
faster on GPUs but names and lays out the weights differently; it is not wired yet.

Tokens reach other ranks' experts through megatron-core's `alltoall` dispatcher: each
expert-parallel rank packs its own micro-batch, of its own length, and the dispatcher's
`all_to_all_single` with uneven splits (which gloo has, so the CPU tests run it) moves them. The
`allgather` dispatcher gathers equal-sized slices (`all_gather_into_tensor`), which packed
micro-batches of different lengths are not: it is refused with expert parallelism (config.py).

Router losses (off by default): megatron-core attaches the load-balancing and z-losses to the
router's outputs only while the router is in training mode, multiplied by the micro-batch's token
count (its `calculate_per_token_loss` convention), with a backward scale that Megatron's own
schedule sets. Here the policy loss is already divided by the minibatch's global token count, so
the scale is 1 / (tokens of the minibatch over all data-parallel ranks): each loss then counts as
its micro-batch's token-weighted share, the same on any layout. Both losses are written for
sequence parallelism (each TP rank a slice of the tokens, the router's gradients summed over TP);
without it every TP rank routes all tokens, and megatron-core's per-rank share would make each
loss 1/TP of its value, so the coefficients are multiplied by TP here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.trainer.megatron.shape import DecoderShape

# Megatron parameter names of routed experts (sharded over expert-parallel ranks).
EXPERT_MARK = ".mlp.experts."


def is_expert_param(name: str) -> bool:
    """Whether a Megatron parameter belongs to a routed expert (held by one expert-parallel rank;
    its gradient is summed over the expert-data-parallel group, not the data-parallel one)."""
    return EXPERT_MARK in name


def check_moe_fits(shape: DecoderShape, tp: int, ep: int) -> None:
    """ValueError naming the key when the experts cannot be split this way."""
    if not shape.is_moe:
        if ep > 1:
            raise ValueError(f"trainer.expert_parallel={ep} needs a mixture-of-experts model; "
                             f"{shape.model_type} has no experts")
        return
    if shape.num_experts % ep:
        raise ValueError(f"trainer.expert_parallel={ep} must divide num_experts={shape.num_experts}")
    if shape.moe_intermediate_size % tp:
        raise ValueError(f"trainer.tensor_parallel={tp} must divide moe_intermediate_size="
                         f"{shape.moe_intermediate_size} (each expert is split over TP ranks)")


def transformer_config_fields(shape: DecoderShape, mcfg, tp: int, ep: int) -> dict:
    """The `TransformerConfig` arguments of a MoE model ({} for a dense one)."""
    if not shape.is_moe:
        return {}
    aux, z = mcfg.moe_aux_loss_coeff, mcfg.moe_z_loss_coeff
    return dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_intermediate_size,
        moe_router_score_function="softmax", moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux * tp, moe_z_loss_coeff=z * tp if z > 0 else None,
        moe_expert_capacity_factor=mcfg.moe_capacity_factor or None,
        moe_token_dispatcher_type=mcfg.moe_token_dispatcher,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
    )


def define_te_gemm_when_absent() -> None:
    """megatron-core 0.16.1's router gating (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, but `moe_utils` defines that name only when TransformerEngine
    imports: without TE (the CPU path, or a GPU without TE) every router forward raised NameError.
    Defining it as None gives the function its own torch.mm branch. Nothing changes with TE. (Set
    through the module's namespace: the name does not exist in such an install, which is the bug,
    and the API contract test rightly refuses attributes the installed release lacks.)"""
    from megatron.core.transformer.moe import moe_utils

    vars(moe_utils).setdefault("te_general_gemm", None)


def routers(module) -> list:
    """Every MoE router (megatron-core's `TopKRouter`, `MoELayer.router`) of a GPTModel stage, in
    layer order."""
    return [layer.mlp.router for layer in module.decoder.layers if hasattr(layer.mlp, "router")]


def router_losses_on(mcfg) -> bool:
    return mcfg.moe_aux_loss_coeff > 0 or mcfg.moe_z_loss_coeff > 0


def set_router_loss_scale(scale: float, device: torch.device) -> None:
    """The backward scale megatron-core gives every attached router loss (see the module doc)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=device))


@dataclass
class RoutingCounts:
    """Per layer (global index) and expert: token assignments that reached the expert, and the
    assignments the router made before any capacity drop (tokens x top-k), summed over a step."""
    routed: torch.Tensor      # [layers, experts], float64
    wanted: torch.Tensor      # [layers], float64


class RouterStats:
    """Counts the routers' assignments during training forwards (not the proximal or reference
    passes, and not the forward a recomputing backward repeats), for `step_metrics`. The counts
    stay on the routers' device until `take` (one host read per step, not one per layer)."""

    def __init__(self, module, num_layers: int, num_experts: int, topk: int):
        self.shape = (num_layers, num_experts)
        self.topk = topk
        self.active = False
        self._routed: torch.Tensor | None = None          # [layers, experts] int64, on the device
        self._wanted = [0] * num_layers                    # assignments asked for (host: shapes only)
        self._hooks = [r.register_forward_hook(self._hook) for r in routers(module)]

    def _hook(self, router, inputs, outputs) -> None:
        # A recomputed forward runs inside the backward pass (graph task id >= 0): counted once.
        if not self.active or torch._C._current_graph_task_id() >= 0:
            return
        _, routing_map = outputs
        layer = router.layer_number - 1
        with torch.no_grad():
            if self._routed is None:
                self._routed = torch.zeros(self.shape, dtype=torch.int64, device=routing_map.device)
            self._routed[layer] += routing_map.sum(dim=0)
        self._wanted[layer] += routing_map.shape[0] * self.topk

    def take(self) -> RoutingCounts:
        """The counts since the last take (this rank's, on the host), and zeroes them."""
        routed = (self._routed.to("cpu", torch.float64) if self._routed is not None
                  else torch.zeros(self.shape, dtype=torch.float64))
        out = RoutingCounts(routed, torch.tensor(self._wanted, dtype=torch.float64))
        if self._routed is not None:
            self._routed.zero_()
        self._wanted = [0] * self.shape[0]
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def routing_metrics(counts: RoutingCounts) -> dict[str, float]:
    """Step metrics from counts summed over every rank that routed distinct tokens.

    `moe_l<i>_load_max`: the busiest expert's share of layer i's assignments times the number of
    experts (1.0 = perfectly even, E = every token on one expert); `moe_l<i>_dropped`: the
    fraction of layer i's assignments dropped by the capacity limit (0 when dropless); and their
    worst layer / overall fraction, `moe_load_max` and `moe_dropped_fraction`."""
    out: dict[str, float] = {}
    routed, wanted = counts.routed, counts.wanted
    if float(wanted.sum()) == 0:
        return out
    experts = routed.shape[1]
    totals = routed.sum(dim=1)
    for i in range(routed.shape[0]):
        if wanted[i] > 0:
            out[f"moe_l{i}_load_max"] = float(routed[i].max() / totals[i].clamp(min=1) * experts)
            out[f"moe_l{i}_dropped"] = float(1 - totals[i] / wanted[i])
    out["moe_load_max"] = max(v for k, v in out.items() if k.endswith("_load_max"))
    out["moe_dropped_fraction"] = float(1 - totals.sum() / wanted.sum())
    return out
