"""Rollout routing replay on the Megatron backend: megatron-core's `TopKRouter` takes its top-k
from the sampler's record (trainer/routing_replay.py says why and what is kept).

The hook is megatron-core 0.16.1's own: `TopKRouter.routing` hands `self.router_replay` to
`topk_routing_with_score_function`, whose `compute_topk` calls its
`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`. Its own
`RouterReplay` (`moe_enable_routing_replay`) keeps every router in one process-wide list and
replays whole tensors only; this object, one per router, replays the recorded rows and lets a row
of -1 (a sequence's last token, never fed to the sampler) route by itself. What it returns is
what megatron-core's own replay returns: the recorded indices and `scores` gathered at them, so
the scores after it (a softmax over the k chosen logits with `norm_topk_prob`, or the k chosen
probabilities of the full softmax) and their gradients are the router's own.

Each router indexes the routes by its global layer (`layer_number - 1`), so a pipeline stage
reads its own layers' columns. With trainer.megatron.recompute the forward a recomputing backward
repeats takes the routes its micro-batch's forward used (RouterReplay's stacks: the pipeline runs
every forward of an update, then the backwards in reverse order).
"""
from __future__ import annotations

import torch

from tandem.trainer.megatron import moe
from tandem.trainer.routing_replay import RouterReplay


class _LayerReplay:
    def __init__(self, state: RouterReplay, layer: int):
        self.state, self.layer = state, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.state.choose(self.layer, own)
        if chosen is own:
            return values, own
        return scores.gather(1, chosen), chosen


def install(module, replay: bool, num_layers: int, recompute: bool = False) -> RouterReplay:
    """Every router of this stage's GPTModel replays through one state (set_routes per forward)."""
    state = RouterReplay(module, replay, routers_of=moe.routers, num_layers=num_layers)
    state.recompute = recompute
    for router in state.routers:
        router.router_replay = _LayerReplay(state, router.layer_number - 1)
    return state
