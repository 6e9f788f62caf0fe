"""Rollout routing replay (R3) on the torch backend: the trainer's Qwen3-MoE routers route each
rollout position through the experts the sampler chose for it.

Why: the sampler (SGLang's kernels, bf16, another batch) and the trainer route some tokens to
different experts, so the trainer's log-probs of the sampled tokens are another model's and the
importance ratios drift; Megatron-LM #4168 saw GRPO on Qwen3-30B-A3B collapse without replay.

How (as slime's `--use-rollout-routing-replay` and Megatron-LM's router replay do): the router
still computes its logits and its softmax over every expert; only the choice of the top k is
taken from the record. The weights of the chosen experts are the router's own probabilities for
them (renormalised over the k with `norm_topk_prob`, as the model does), so the router gets
gradients as usual; only which experts receive the token is fixed. A position without a record
(the last token of a sequence, which the sampler never fed; a row of -1) routes by itself.

The routes of one forward are set on the model before it (`set_routes`, [tokens, layers, k] in
the forward's token order) and stay until the next. With activation recompute (`recompute`) each
layer also keeps the routes of every training forward on a stack that the forward a recomputing
backward repeats pops: the backwards of a pipeline stage run after all its micro-batches'
forwards, in reverse order. A router that sees another number of tokens than the routes hold
raises, never routes by the wrong rows.

The agreement metric: for every recorded position, whether the trainer's own top-k set equals
the sampler's, counted with replay on or off (with replay on it measures what replay corrects).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def routers(model) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("MoeTopKRouter")]


class RouterReplay:
    """Installed on a model once: its routers take their top-k from `routes` where recorded
    (`replay`), and count their own agreement with the record."""

    def __init__(self, model, replay: bool, routers_of=None, num_layers: int | None = None):
        self.replay = replay
        self.routers = (routers_of or routers)(model)
        self.num_layers = len(self.routers) if num_layers is None else num_layers   # all stages'
        self.routes: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None    # [agreeing, compared], on the model's device
        self.recompute = False                      # keep each training forward's routes (doc)
        self._stacks: dict[int, list] = {}
        if routers_of is None:       # transformers' routers: their forward takes its top-k here
            for layer, router in enumerate(self.routers):
                router.forward = types.MethodType(_forward(self, layer), router)

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """[tokens, layers, k] expert ids (-1 rows: route by itself) for the next forwards, or None."""
        if routes is not None and routes.shape[1] != self.num_layers:
            raise ValueError(f"routing replay: routes for {routes.shape[1]} layers, the model routes {self.num_layers}")
        self.routes = routes

    def clear_stacks(self) -> None:
        """Forget kept routes (an update that stopped between its forwards and backwards)."""
        self._stacks.clear()

    def take_agreement(self) -> tuple[float, float]:
        """(agreeing, compared) token-layer top-k sets since the last call (one host read)."""
        if self._counts is None:
            return 0.0, 0.0
        agreeing, compared = self._counts.tolist()
        self._counts = None
        return agreeing, compared

    def choose(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s experts for its tokens: the recorded ones where there are routes and
        replay is on, else `own` (the router's top-k, [tokens, k]); counts the agreement, except
        in the forward a recomputing backward repeats (counted once)."""
        routes = self.routes
        recomputed = torch._C._current_graph_task_id() >= 0     # inside a backward pass
        if self.recompute and torch.is_grad_enabled():
            stack = self._stacks.setdefault(layer, [])
            if recomputed:
                routes = stack.pop() if stack else routes
            else:
                stack.append(routes)
        if routes is None:
            return own
        recorded = routes[:, layer].to(own.device, torch.long)
        if recorded.shape != own.shape:
            raise RuntimeError(f"routing replay: layer {layer}'s router saw {own.shape[0]} tokens x top-"
                               f"{own.shape[1]}, the routes hold {tuple(recorded.shape)}")
        given = recorded[:, 0] >= 0
        if not recomputed:
            with torch.no_grad():
                same = (own.sort(-1).values == recorded.sort(-1).values).all(-1) & given
                c = torch.stack([same.sum(), given.sum()]).to(torch.float64)
                self._counts = c if self._counts is None else self._counts + c
        return torch.where(given[:, None], recorded, own) if self.replay else own


def _forward(state: RouterReplay, layer: int):
    """transformers' `Qwen3MoeTopKRouter.forward` with the top-k choice from `state.choose`."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
        _, own = torch.topk(probs, self.top_k, dim=-1)
        chosen = state.choose(layer, own)
        top = probs.gather(1, chosen)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return router_logits, top.to(router_logits.dtype), chosen
    return forward
