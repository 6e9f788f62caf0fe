"""The optimizer's state in model space: per parameter, its fp32 main weight and Adam moments.

Why one model-space view: the Megatron backend has three optimizers — torch AdamW over the
local shards (CPU), and on GPUs megatron-core's `Float16OptimizerWithFloat16Params` or its
`DistributedOptimizer` (state sharded over data-parallel ranks) — and each lays out and
checkpoints its state its own way, so a checkpoint written by one could not be read by another
(a GPU run would not resume on the CPU path, nor after switching `use_distributed_optimizer`).
Here every one of them is read and written as `{parameter name: {"param", "exp_avg",
"exp_avg_sq"}}`, full tensors of this rank's tensor-parallel shard in float32, plus the step
(= the backend's update count): dist_ckpt.py saves exactly that on the model's sharding, and
export reads "param" (the weights training holds, fp32 even when the parameters are bf16).

How megatron-core 0.16.1 keeps the state (read from its source): `Float16OptimizerWithFloat16Params`
records the fp32 copy as `param.main_param` and keys its inner torch optimizer's state by it
(fp32 parameters are their own main weights); `DistributedOptimizer` gives each DP rank a
contiguous range of every parameter (`_get_model_param_range_map(p)["param"]`) and returns that
range's main weight and moments with `_get_main_param_and_optimizer_states(p)`; a DP rank holding
none of a parameter is absent from its `model_param_gbuf_map`. Full tensors are rebuilt by
summing zero-padded ranges over the DP group (a collective: every rank must call).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from tandem.services.protocol import collectives

if TYPE_CHECKING:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

KINDS = ("param", "exp_avg", "exp_avg_sq")
# (name, parameter, this rank's tensors by kind (None: it holds none), their place in the
# flattened parameter (None: all of it), the DP group the places are spread over (or None)).
Slot = tuple[str, torch.nn.Parameter, "dict[str, torch.Tensor] | None", "slice | None", object]


def _megatron_optimizers(optimizer) -> list:
    """`get_megatron_optimizer` returns a ChainedOptimizer (one per buffer group)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(opt: DistributedOptimizer, p: torch.nn.Parameter) -> tuple[dict | None, slice | None]:
    if p not in opt.model_param_gbuf_map:
        return None, None
    r = opt._get_model_param_range_map(p)["param"]
    return opt._get_main_param_and_optimizer_states(p), slice(r.start, r.end)


def _slots(model, optimizer) -> Iterator[Slot]:
    """Every parameter of `model` (GPTModel names, the same order on every rank) with its state."""
    if isinstance(optimizer, torch.optim.Optimizer):   # the CPU path's AdamW over the parameters
        for name, p in model.named_parameters():
            yield name, p, {"param": p, **optimizer.state[p]}, None, None
        return
    opts = _megatron_optimizers(optimizer)
    dist_opt = next((o for o in opts if hasattr(o, "model_param_gbuf_map")), None)
    states = {}
    for opt in opts:
        inner = opt.optimizer
        for group in inner.param_groups:
            for key in group["params"]:
                states[key] = inner.state[key]
    for name, p in model.named_parameters():
        if dist_opt is not None:
            tensors, place = _distributed(dist_opt, p)
            yield name, p, tensors, place, dist_opt.data_parallel_group
        else:
            key = p.main_param if getattr(p, "main_param", None) is not None else p
            yield name, p, {"param": key, **states[key]}, None, None


def init_state(optimizer, step: int) -> None:
    """Give every parameter Adam state (zero moments) at `step`, as a step would have: a fresh
    optimizer has none, and the loaders below write into it. torch's Adam(W) (the CPU path, and
    megatron-core's fallback without TransformerEngine or Apex) keeps `step` per parameter;
    Megatron's `init_state_fn` allocates the state of the optimizer it chose."""
    if isinstance(optimizer, torch.optim.Optimizer):
        inners, init_fns = [optimizer], [None]
    else:
        opts = _megatron_optimizers(optimizer)
        inners, init_fns = [o.optimizer for o in opts], [(o.init_state_fn, o.config) for o in opts]
    for inner, init in zip(inners, init_fns, strict=True):
        if init is not None and init[0] is not None:
            init[0](inner, init[1])
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))
                if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                    st["step"] = torch.tensor(float(step))
            if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                group["step"] = step     # fused Adams (TE, Apex) count steps per group


def read(model, optimizer, kinds=KINDS) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {kind: full fp32 tensor of this rank's TP shard}}, on the CPU.

    Collective over the DP group with the distributed optimizer: every rank must call it.
    """
    out = {}
    for name, p, tensors, place, group in _slots(model, optimizer):
        entry = {}
        for kind in kinds:
            if place is None and group is None:
                t = tensors.get(kind)
                t = torch.zeros_like(p, dtype=torch.float32) if t is None else t.detach().float().view_as(p)
            else:
                t = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                src = None if tensors is None else tensors.get(kind)
                if src is not None:
                    t[place] = src.detach().reshape(-1).float()
                t = collectives.all_reduce(t, group=group).view_as(p)
            entry[kind] = t.cpu().clone()
        out[name] = entry
    return out


def write(model, optimizer, state: dict[str, dict[str, torch.Tensor]], kinds=KINDS) -> int:
    """Copy full tensors (this rank's TP shards, GPTModel names) into the optimizer's state (run
    `init_state` first on a fresh optimizer); returns how many parameters were written. "param"
    writes the fp32 main weights: the parameter itself where it is its own (fp32), which a
    checkpoint written from bf16 parameters then gives its fp32 values, not their rounding."""
    n = 0
    for name, _, tensors, place, _ in _slots(model, optimizer):
        if name not in state:
            continue     # not in the model's sharded state dict (nothing was saved for it)
        n += 1
        if tensors is None:
            continue
        for kind in kinds:
            dst = tensors[kind]
            src = state[name][kind].to(dst.device, torch.float32)
            with torch.no_grad():   # "param" may be the parameter itself (fp32: its own main weight)
                dst.copy_((src if place is None else src.reshape(-1)[place]).view_as(dst))
    return n


def main_params(model, optimizer) -> dict[str, torch.Tensor]:
    """{name: fp32 main weight} (collective, see `read`): what export writes."""
    return {n: e["param"] for n, e in read(model, optimizer, kinds=("param",)).items()}


def load_main_params(model, optimizer, state: dict[str, torch.Tensor]) -> int:
    """Give the main weights full-precision values (e.g. the HF checkpoint's, after the optimizer
    made them from the rounded bf16 parameters)."""
    return write(model, optimizer, {n: {"param": t} for n, t in state.items()}, kinds=("param",))
