"""The experts each token was routed to, captured from the embedded server's MoE forwards.

Rollout routing replay (R3) needs what SGLang 0.5.23 returns with `return_routed_experts`:
for every position the model was fed, each MoE layer's top-k expert ids, in
`meta_info.routed_experts` as base64 of an int32 array (positions, layers, top_k) covering
positions `[routed_experts_start_len, seqlen - 1)` (the last sampled token was never fed to the
model, so it has no routing). The trainer routes the same positions through the same experts.

How it is captured: a forward hook on every router of transformers' Qwen3-MoE
(`Qwen3MoeTopKRouter`, which returns `(logits, scores, indices)`) keeps that layer's indices of
the current forward. The engine reads them after each forward (`take`): a prefill's rows are its
sequence's positions, a decode step's are the running rows in order (a decode step may take two
passes, the batch's rectangle then the long rows', each through every layer, so one layer's
captures concatenate in row order). Nothing is copied until a request that asked reads them.

A position keeps the routing it had the first time it was fed: a request re-prefilled after a
weight update (retract) keeps the experts its earlier tokens were generated with, as a sample
resubmitted after an abort keeps each segment's (the client joins the segments).
"""
from __future__ import annotations

import base64

import torch


def routers(model) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("MoeTopKRouter")]


class RoutingCapture:
    """Hooks on a model's routers; `take()` gives the last forward's indices [tokens, layers, k]."""

    def __init__(self, model):
        self._routers = routers(model)
        self._seen: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    @property
    def enabled(self) -> bool:
        return bool(self._routers)

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            self._seen[layer].append(output[2])     # (tokens, k) int64, on the model's device
        return hook

    def clear(self) -> None:
        for seen in self._seen:
            seen.clear()

    def take(self) -> torch.Tensor | None:
        """What the forwards since the last take routed: int32 [tokens, layers, k] on the CPU,
        or None for a dense model."""
        if not self.enabled:
            return None
        layers = [torch.cat(seen, 0) if len(seen) > 1 else seen[0] for seen in self._seen]
        self.clear()
        return torch.stack(layers, 1).to("cpu", torch.int32)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def encode(chunks: list[torch.Tensor], start: int) -> str:
    """Positions `[start, ...)` of a request's routing (its chunks [n, layers, k] in position
    order) as SGLang sends them: base64 of little-endian int32."""
    if not chunks:
        return ""
    rows = torch.cat(chunks, 0)[start:]
    return base64.b64encode(rows.numpy().astype("<i4").tobytes()).decode("ascii")
