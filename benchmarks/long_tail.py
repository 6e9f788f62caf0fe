"""A long-tailed workload for benchmarks/async_vs_sync.py, where generation is the bottleneck.

The warmed-up tiny model answers in ~31 tokens, so on the default workload the trainer is the
slower pool. Reasoning models are the other way round: most answers are short, a few run for
ten times as long, and a synchronous step waits for the longest one while the server decodes
it at a batch of one or two. This workflow (`rollout.workflow: benchmarks.long_tail:episode`)
reproduces that shape: each sample's length is drawn from a lognormal (median MEDIAN tokens,
log-space sigma SIGMA: mean ~1.6x the median, about 1 sample in 25 over 6x it), capped at
`rollout.max_new_tokens`, and generated to exactly that length (`ignore_eos`). The draw is
seeded by prompt and sample index, so every variant of the benchmark sees the same lengths.
The answer is still graded, but the text after the model's own end is noise: this workload
measures throughput and interruption, not learning.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

from tandem.rollout.workflow import single_turn

MEDIAN = 48
SIGMA = 1.0
MIN_TOKENS = 8


def sample_length(key: str, cap: int) -> int:
    """The length of one sample: lognormal(MEDIAN, SIGMA) in [MIN_TOKENS, cap], seeded by `key`."""
    draw = random.Random(key).lognormvariate(math.log(MEDIAN), SIGMA)
    return max(min(MIN_TOKENS, cap), min(cap, round(draw)))


async def episode(ctx, prompt, ticket):
    """The default single-turn episode, with each sample's own length forced."""
    cap = int(ctx.sampling_params["max_new_tokens"])
    index = itertools.count()

    async def generate(prompt_ids, params, sticky_key):
        n = sample_length(f"{prompt.id}/{next(index)}", cap)
        return await ctx.generate(prompt_ids, {**params, "max_new_tokens": n, "ignore_eos": True}, sticky_key)

    return await single_turn(dataclasses.replace(ctx, generate=generate), prompt, ticket)
