"""A mixture-of-experts model's weights under the Hub's names, from transformers 5's fused experts.

transformers 5 holds a Qwen3-MoE layer's experts as two 3-D parameters (`mlp.experts.gate_up_proj`
[experts, 2 x ffn, hidden], each expert's gate rows then its up rows; `mlp.experts.down_proj`
[experts, hidden, ffn]); the Hub's checkpoints, SGLang's loader and `save_pretrained` name one
tensor per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`). What the torch backend sends
over a weight broadcast is named as those are, so a generation server of either kind takes it as
it takes a checkpoint (the embedded server fuses them back: rollout/server/expert_weights.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_FUSED = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hub_tensors(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as the Hub names it: a fused expert parameter as one tensor per expert (and
    per gate/up), anything else unchanged."""
    match = _FUSED.match(name)
    if match is None or t.dim() != 3:
        yield name, t
        return
    prefix, kind = match.groups()
    for e in range(t.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
