"""Mixture-of-experts weights in the Hub's names, for a model that transformers 5 serves fused.

A Qwen3-MoE checkpoint on the Hub, what SGLang loads, what `save_pretrained` writes and what both
trainer backends publish (disk or broadcast) hold one tensor per expert:
`<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`. transformers 5 keeps a layer's experts as
two 3-D parameters instead, `<layer>.mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden] (each
expert's gate rows, then its up rows: its forward chunks the product in two) and
`<layer>.mlp.experts.down_proj` [experts, hidden, ffn]; its loader maps one to the other, but a
weight update names tensors itself. `served` turns the per-expert tensors of an update into the
served parameters: a copy of each touched fused parameter with the given experts written in, so a
partial update (a broadcast may send part of the model) changes only what it names, and a full
one (from disk) must name every expert. Any other name passes through for `weights.validate`.
"""
from __future__ import annotations

import re

import torch

_HUB = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def served(model, state: dict[str, torch.Tensor], *, partial: bool, error=ValueError) -> dict[str, torch.Tensor]:
    """`state` with per-expert tensors replaced by the fused parameters they belong to (`error`:
    the exception class a bad tensor raises, naming it)."""
    want = model.state_dict()
    by_layer: dict[str, list] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        match = _HUB.match(name)
        if match is None or f"{match.group(1)}.gate_up_proj" not in want:
            out[name] = t
        else:
            by_layer.setdefault(match.group(1), []).append((int(match.group(2)), match.group(3), name, t))
    for prefix, parts in by_layer.items():
        gate_up = want[f"{prefix}.gate_up_proj"].detach().clone()
        down = want[f"{prefix}.down_proj"].detach().clone()
        experts, ffn = gate_up.shape[0], gate_up.shape[1] // 2
        seen = set()
        for e, kind, name, t in parts:
            if e >= experts:
                raise error(f"tensor {name}: the served model has {experts} experts per layer")
            target = {"gate_proj": gate_up[e, :ffn], "up_proj": gate_up[e, ffn:], "down_proj": down[e]}[kind]
            if tuple(t.shape) != tuple(target.shape):
                raise error(f"tensor {name}: shape {list(t.shape)} != served {list(target.shape)}")
            with torch.no_grad():
                target.copy_(t)
            seen.add((e, kind))
        if not partial and len(seen) < 3 * experts:
            missing = sorted(f"{prefix}.{e}.{k}_proj.weight" for e in range(experts) for k in ("gate", "up", "down")
                             if (e, f"{k}_proj") not in seen)
            raise error(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if any(kind != "down_proj" for _, kind, _, _ in parts):
            out[f"{prefix}.gate_up_proj"] = gate_up
        if any(kind == "down_proj" for _, kind, _, _ in parts):
            out[f"{prefix}.down_proj"] = down
    return out
