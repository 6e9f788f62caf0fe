"""A long-tailed workload whose lengths grow during the run, for benchmarks/elastic_split.py.

Reasoning models lengthen their answers during RL (DeepSeek-R1-Zero's grew several-fold), so the
generation:training split that is fastest at the start is not the fastest at the end, which is
what `launcher.elastic` is for. The warmed-up tiny model answers in ~31 tokens and never grows,
so this workflow (`rollout.workflow: benchmarks.growing_lengths:episode`) forces the shape:

- each sample's length is a lognormal draw around a median (log-space sigma SIGMA, as
  benchmarks/long_tail.py: a long tail), capped at `rollout.max_new_tokens` and generated to
  exactly that length (`ignore_eos`);
- the median grows geometrically with the policy version the group was admitted at
  (`ticket.admit_version`, the controller's version when it granted the ticket: the number of
  versions the trainer has published), from START_MEDIAN at version 0 to
  START_MEDIAN * GROWTH at version OVER_VERSIONS and no further. The pools' balance moves
  with the lengths: the trainer's cost follows the tokens it trains (the prompt's too) plus a
  step's fixed costs, generation's follows the decoded tokens plus the prefill passes of the
  requests it admits (rollout/server/engine.py: one prefill each), so which split is fastest changes
  during the run; which way is for the benchmark to measure (benchmarks/elastic_split.py);
- the draw is seeded by prompt and sample index alone, so every run (fixed split or elastic)
  sees the same lengths for the same prompt at the same version, and a sample admitted later is
  the median's ratio times longer (rounded, capped) than the same sample admitted earlier.

`growing(start, growth, over)` makes an episode of another shape; the module's episodes are the
benchmark's full run (`episode`), its calibration at the start's lengths (`start_episode`, no
growth: what a user measures before choosing a split) and its mechanics check (`quick_episode`,
the same growth over QUICK_VERSIONS). The answer is still graded, but the text after the model's
own end is noise: this workload measures throughput, not learning.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

from tandem.rollout.workflow import single_turn

START_MEDIAN = 12      # tokens, at version 0 (prompts are ~12 tokens)
GROWTH = 12.0          # the median at OVER_VERSIONS over the one at version 0
OVER_VERSIONS = 120    # = the benchmark's trainer.total_steps: the growth spans the run
QUICK_VERSIONS = 4     # the --quick run's steps
SIGMA = 1.0            # log-space spread: mean ~1.6x the median, ~1 sample in 25 over 6x it
MIN_TOKENS = 4


def median_at(version: int, start: float = START_MEDIAN, growth: float = GROWTH,
              over: int = OVER_VERSIONS) -> float:
    """The median length of a sample admitted at `version`: start * growth ** (version / over),
    constant before version 0 and after `over`."""
    frac = min(max(version, 0), over) / over if over > 0 else 1.0
    return start * growth ** frac


def sample_length(key: str, version: int, cap: int, start: float = START_MEDIAN, growth: float = GROWTH,
                  over: int = OVER_VERSIONS) -> int:
    """One sample's length: median_at(version) times a lognormal(0, SIGMA) factor seeded by
    `key`, in [MIN_TOKENS, cap]."""
    factor = random.Random(key).lognormvariate(0.0, SIGMA)
    return max(min(MIN_TOKENS, cap), min(cap, round(median_at(version, start, growth, over) * factor)))


def growing(start: float, growth: float, over: int):
    """An episode function whose lengths grow as median_at(admit version, start, growth, over)."""
    async def episode(ctx, prompt, ticket):
        """The default single-turn episode, each sample's length forced by its admission version."""
        cap = int(ctx.sampling_params["max_new_tokens"])
        index = itertools.count()

        async def generate(prompt_ids, params, sticky_key):
            n = sample_length(f"{prompt.id}/{next(index)}", ticket.admit_version, cap, start, growth, over)
            return await ctx.generate(prompt_ids, {**params, "max_new_tokens": n, "ignore_eos": True}, sticky_key)

        return await single_turn(dataclasses.replace(ctx, generate=generate), prompt, ticket)

    return episode


episode = growing(START_MEDIAN, GROWTH, OVER_VERSIONS)
start_episode = growing(START_MEDIAN, 1.0, OVER_VERSIONS)
quick_episode = growing(START_MEDIAN, GROWTH, QUICK_VERSIONS)
