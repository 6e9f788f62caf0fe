"""The growing workload of benchmarks/elastic_split.py (benchmarks/growing_lengths.py): its median
grows geometrically with the admission version from START_MEDIAN to START_MEDIAN * GROWTH and no
further, each sample's length is seeded by prompt and sample index (so the fixed and the elastic
run see the same lengths), every length is capped at max_new_tokens, and the episode forces those
lengths on the server (`max_new_tokens` per request, `ignore_eos`) from the ticket's version."""
from __future__ import annotations

import asyncio
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import growing_lengths as g
from tandem.rollout.dataset import Prompt
from tandem.rollout.workflow import EpisodeContext
from tandem.services.protocol import Ticket, Verdict


def lengths_at(version: int, cap: int = 10_000, n: int = 4000, **shape) -> list[int]:
    return [g.sample_length(f"p{i}/{i % 8}", version, cap, **shape) for i in range(n)]


def test_the_median_grows_geometrically_from_the_start_to_growth_times_it_and_no_further():
    assert g.median_at(0) == g.START_MEDIAN
    assert g.median_at(g.OVER_VERSIONS) == pytest.approx(g.START_MEDIAN * g.GROWTH)
    assert g.median_at(g.OVER_VERSIONS // 2) == pytest.approx(g.START_MEDIAN * g.GROWTH ** 0.5, rel=0.02)
    ratios = [g.median_at(v + 10) / g.median_at(v) for v in range(0, g.OVER_VERSIONS - 10, 10)]
    assert max(ratios) == pytest.approx(min(ratios))   # the same factor every 10 versions: geometric
    assert g.median_at(g.OVER_VERSIONS * 3) == g.median_at(g.OVER_VERSIONS)
    assert g.median_at(-5) == g.START_MEDIAN
    assert g.median_at(7, start=10, growth=4, over=0) == 40   # no span: grown from the start
    # "several times longer by the end"
    assert g.GROWTH >= 4 and g.OVER_VERSIONS >= 20


@pytest.mark.parametrize("version", [0, g.OVER_VERSIONS // 2, g.OVER_VERSIONS])
def test_the_drawn_lengths_have_that_median(version):
    drawn = lengths_at(version)
    assert statistics.median(drawn) == pytest.approx(g.median_at(version), rel=0.08)
    # a long tail: the mean well above the median, some samples several times it
    assert statistics.mean(drawn) > 1.3 * statistics.median(drawn)
    assert max(drawn) > 5 * g.median_at(version)


def test_lengths_are_seeded_by_prompt_and_sample_index():
    assert lengths_at(40, n=200) == lengths_at(40, n=200)                 # same key: same length, every run
    assert g.sample_length("a/0", 40, 448) != g.sample_length("a/1", 40, 448) or \
        g.sample_length("b/0", 40, 448) != g.sample_length("b/1", 40, 448)
    # the same sample admitted later is the median's ratio longer (rounded): one draw per key
    early, late = np.array(lengths_at(0, n=500), float), np.array(lengths_at(g.OVER_VERSIONS, n=500), float)
    big = early >= 40   # rounding matters little there
    ratio = late[big] / early[big]
    assert ratio == pytest.approx(np.full(big.sum(), g.GROWTH), rel=0.02)


def test_lengths_are_capped_at_max_new_tokens_and_at_least_the_minimum():
    for version in (0, g.OVER_VERSIONS):
        drawn = lengths_at(version, cap=96)
        assert max(drawn) == 96 and min(drawn) >= g.MIN_TOKENS
    assert set(lengths_at(g.OVER_VERSIONS, cap=2, n=100)) <= {1, 2}   # a cap below the minimum wins


def test_the_episode_forces_each_samples_length_from_the_tickets_admission_version():
    sent = []

    async def generate(prompt_ids, params, sticky_key):
        sent.append((sticky_key, params))
        n = params["max_new_tokens"]
        return SimpleNamespace(output_ids=[5] * n, output_logprobs=[0.0] * n, output_versions=[0] * n,
                               finish_reason="length")

    async def grade(items):
        return [Verdict(reward=-1.0, correct=False, details={}) for _ in items]

    tokenizer = SimpleNamespace(apply_chat_template=lambda *a, **k: [1, 2, 3], decode=lambda ids, **k: "x")
    ctx = EpisodeContext(generate=generate, grade=grade, tokenizer=tokenizer, n_samples=4,
                         sampling_params={"max_new_tokens": 448, "temperature": 1.0})
    prompt = Prompt(id="q7", text="1+1", task="math", reference={"answer": "2"})
    version = g.OVER_VERSIONS // 3
    trajectories = asyncio.run(g.episode(ctx, prompt, Ticket(group_id="g1", admit_version=version)))
    expected = [g.sample_length(f"q7/{i}", version, 448) for i in range(4)]
    assert [len(t.output_ids) for t in trajectories] == expected
    assert [p["max_new_tokens"] for _, p in sent] == expected and all(p["ignore_eos"] for _, p in sent)
    assert all(p["temperature"] == 1.0 for _, p in sent)   # the run's other settings go through
    # the calibration's episode does not grow; the quick one grows over the quick run's versions
    sent.clear()
    asyncio.run(g.start_episode(ctx, prompt, Ticket(group_id="g2", admit_version=version)))
    assert [p["max_new_tokens"] for _, p in sent] == [g.sample_length(f"q7/{i}", 0, 448) for i in range(4)]
    sent.clear()
    asyncio.run(g.quick_episode(ctx, prompt, Ticket(group_id="g3", admit_version=g.QUICK_VERSIONS)))
    assert [p["max_new_tokens"] for _, p in sent] == [g.sample_length(f"q7/{i}", g.OVER_VERSIONS, 448)
                                                      for i in range(4)]
