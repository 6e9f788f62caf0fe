"""Hugging Face Qwen3-MoE <-> Megatron-core MoE layer weights, and their expert-parallel shards.

Names (transformers 5 saves, and SGLang and the Hub's Qwen3-MoE checkpoints hold, one tensor per
expert; in memory transformers fuses them, `experts.gate_up_proj`, and its loader maps both):

- `mlp.gate.weight` [experts, hidden] (the router) <-> `mlp.router.weight`, replicated on every
  rank (a float32 parameter in megatron-core whatever params_dtype is: its logits are float32);
- `mlp.experts.<e>.gate_proj/up_proj.weight` <-> `mlp.experts.local_experts.<e>.linear_fc1.weight`
  = [gate; up], per TP rank as the dense MLP's (convert.shard);
- `mlp.experts.<e>.down_proj.weight` <-> `...local_experts.<e>.linear_fc2.weight` (TP: columns);
- `post_attention_layernorm.weight` <-> `pre_mlp_layernorm.weight` on both layer specs (the
  TransformerEngine spec fuses the norm into the MLP's first linear only for a dense MLP).

The full Megatron tensors use global expert indices (`local_experts.<e>` with e over all experts,
what one expert-parallel rank would hold); `ep_shard` keeps one rank's contiguous block of
`num_experts / ep` experts renumbered from 0 (megatron-core's `local_expert_indices`), `ep_merge`
puts every rank's back.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

from tandem.trainer.megatron.shape import DecoderShape

MLP_NORM = "pre_mlp_layernorm.weight"
ROUTER = "mlp.router.weight"
_EXPERT = re.compile(r"^(.*mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_LOCAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def layer_to_megatron(get: Callable[[str], torch.Tensor], h: str, shape: DecoderShape) -> dict[str, torch.Tensor]:
    """One layer's MLP tensors (names within the layer) from HF names under prefix `h`."""
    out = {MLP_NORM: get(h + "post_attention_layernorm.weight"), ROUTER: get(h + "mlp.gate.weight")}
    for e in range(shape.num_experts):
        x = f"{h}mlp.experts.{e}."
        out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
            [get(x + "gate_proj.weight"), get(x + "up_proj.weight")])
        out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = get(x + "down_proj.weight")
    return out


def layer_to_hf(rest: str, t: torch.Tensor, h: str) -> dict[str, torch.Tensor] | None:
    """HF tensors for one Megatron MLP tensor (`rest`: its name within layer prefix `h`), None when
    `rest` is no MoE name (full tensors: global expert indices)."""
    if rest == MLP_NORM:
        return {h + "post_attention_layernorm.weight": t}
    if rest == ROUTER:
        return {h + "mlp.gate.weight": t}
    match = _LOCAL.match(rest)
    if match is None:
        return None
    x = f"{h}mlp.experts.{int(match.group(1))}."
    if match.group(2) == "linear_fc2":
        return {x + "down_proj.weight": t}
    gate, up = torch.chunk(t, 2, dim=0)
    return {x + "gate_proj.weight": gate, x + "up_proj.weight": up}


def expert_index(name: str) -> int | None:
    """The expert index in a Megatron name, None for a name of no expert."""
    match = _EXPERT.match(name)
    return None if match is None else int(match.group(2))


def _renumber(name: str, index: int) -> str:
    match = _EXPERT.match(name)
    return f"{match.group(1)}{index}{match.group(3)}"


def ep_shard(full: dict[str, torch.Tensor], rank: int, size: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Expert-parallel rank `rank`'s tensors of a full Megatron state: every non-expert tensor, and
    its own experts renumbered from 0."""
    if size == 1:
        return full
    per_rank = num_experts // size
    lo = rank * per_rank
    out = {}
    for name, t in full.items():
        e = expert_index(name)
        if e is None:
            out[name] = t
        elif lo <= e < lo + per_rank:
            out[_renumber(name, e - lo)] = t
    return out


def ep_merge(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `ep_shard` over every expert-parallel rank's tensors (in rank order); the
    non-expert tensors are taken from rank 0."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for rank, part in enumerate(parts):
        local = {expert_index(n) for n in part} - {None}
        per_rank = len(local)
        for name, t in part.items():
            e = expert_index(name)
            if e is None:
                if rank == 0:
                    out[name] = t
            else:
                out[_renumber(name, rank * per_rank + e)] = t
    return out
