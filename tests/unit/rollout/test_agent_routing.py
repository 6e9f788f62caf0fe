"""Routed experts of an agent episode (routing replay, rollout/agent_client.py + workflow.ExpertsJoin).

Every completion is a generation request over the episode so far and returns the experts of every
position it fed; the trajectory keeps, for each position, the experts of the first completion that
fed it (the tool results between two completions are first fed by the next one), and covers
exactly prompt + output - 1 positions. With routing not recorded (replies without experts) the
trajectory is what it was, with none.

The stand-ins are test_agent_tokens.py's (scripted completions, the tiny tokenizer with a
Qwen3-like template); the scripted model here also returns experts that name, in every row, the
request that computed it and the position: request k routes position p to [[k, p], [p, k]].
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_agent_tokens import ANSWER, QWEN3_LIKE, SAMPLING, THINK_CALL, TOOLS, ScriptedModel

from tandem.rollout.agent import AgentSettings, agent_episodes
from tandem.rollout.dataset import Prompt
from tandem.rollout.workflow import EpisodeContext, ExpertsJoin
from tandem.services.protocol import Ticket, Verdict
from tandem.trainer.buffer import validate

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """test_agent_tokens.py's tokenizer: the tiny model's, with the Qwen3-like template."""
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.chat_template = QWEN3_LIKE
    return t


class RoutedModel(ScriptedModel):
    """ScriptedModel whose every request also returns the experts of positions [0, fed + out - 1)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.returned: list[np.ndarray] = []

    async def generate(self, prompt_ids, params, key):
        sample = await super().generate(prompt_ids, params, key)
        k, p = len(self.returned), np.arange(len(prompt_ids) + len(sample.output_ids) - 1)
        kk = np.full_like(p, k)
        sample.routed_experts = np.stack([np.stack([kk, p], 1), np.stack([p, kk], 1)], 1).astype(np.int32)
        self.returned.append(sample.routed_experts)
        return sample


async def _calls_until_answer(row, client):
    """The calculator's loop: a tool result after each call, until a reply without one."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        message = (await client.chat.completions.create(messages=messages, tools=TOOLS)).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return 1.0
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "188"} for c in message.tool_calls]


def _run(model, tok, agent=_calls_until_answer, max_turns=4, context=4096):
    async def grade(items):
        return [Verdict(reward=1.0, correct=True, details={}) for _ in items]
    ctx = EpisodeContext(generate=model.generate, grade=grade, tokenizer=tok, n_samples=1, sampling_params=SAMPLING)
    settings = AgentSettings(agent=agent, max_turns=max_turns, context_tokens=context, timeout_s=30.0,
                             limit_reward=-1.0, tool_format="hermes")
    prompt = Prompt(id="p1", text="13*15-7=?", task="math", reference={"answer": "188"})
    [t] = asyncio.run(agent_episodes(ctx, prompt, Ticket(group_id="g", admit_version=0), settings=settings))
    return t


def _first_fed(model) -> list[tuple[int, int]]:
    """[start, end) of the positions each request fed first: its context plus its output but the
    last token, from where the previous request's record ended."""
    spans, covered = [], 0
    for seen, sample in zip(model.seen, model.sampled, strict=True):
        end = len(seen) + len(sample.output_ids) - 1
        spans.append((covered, end))
        covered = end
    return spans


def test_three_completions_keep_each_requests_experts_for_the_positions_it_first_fed(tok):
    model = RoutedModel(tok, [THINK_CALL, THINK_CALL, ANSWER])
    t = _run(model, tok)
    assert t.timings["turns"] == 3.0 and np.any(t.output_mask == 0)   # tool results between the completions
    positions = len(t.prompt_ids) + len(t.output_ids) - 1
    assert t.routed_experts.shape == (positions, LAYERS, TOP_K)
    assert validate(t, vocab_size=len(tok), routing=(LAYERS, TOP_K, 2**16)) is None

    spans = _first_fed(model)
    assert spans[-1][1] == positions
    for k, (start, end) in enumerate(spans):
        assert start < end
        assert np.array_equal(t.routed_experts[start:end], model.returned[k][start:end]), k
        assert (t.routed_experts[start:end, 0, 0] == k).all(), k
    # Read from the trajectory's side: a tool result's tokens (and the last token of the completion
    # before them, which its own request never fed) carry the experts of the completion after them.
    P, mask, k, checked = len(t.prompt_ids), t.output_mask, 0, 0
    for j in range(len(mask)):
        k += bool(j and mask[j] and not mask[j - 1])     # completion k is the latest begun
        if not mask[j] or (j + 1 < len(mask) and not mask[j + 1]):   # a tool result's token, or the one before
            assert t.routed_experts[P + j, 0, 0] == k + 1, j
            checked += 1
    assert checked == np.sum(mask == 0) + 2
    assert np.array_equal(t.routed_experts[:, 0, 1], np.arange(positions))  # every row its own position


def test_an_episode_ended_by_its_context_limit_keeps_exactly_the_fed_positions(tok):
    """The limit is met after a tool result is appended: those tokens are dropped with the reply
    that never came, and every position left was fed by some completion."""
    async def loops(row, client):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
            messages += [reply.choices[0].message, {"role": "tool", "content": "188"}]

    model = RoutedModel(tok, [THINK_CALL] * 10)
    t = _run(model, tok, agent=loops, max_turns=9, context=600)
    assert t.finish_reason == "context_limit" and 2 <= len(model.sampled) < 9
    positions = len(t.prompt_ids) + len(t.output_ids) - 1
    assert _first_fed(model)[-1][1] == positions
    assert np.array_equal(t.routed_experts, np.concatenate([model.returned[k][a:b]
                                                            for k, (a, b) in enumerate(_first_fed(model))]))


def test_without_recorded_routing_the_trajectory_is_unchanged_and_has_none(tok):
    plain = _run(ScriptedModel(tok, [THINK_CALL, ANSWER]), tok)
    routed = _run(RoutedModel(tok, [THINK_CALL, ANSWER]), tok)
    assert plain.routed_experts is None and routed.routed_experts is not None
    for field in ("prompt_ids", "output_ids", "output_logprobs", "output_versions", "output_mask"):
        assert np.array_equal(getattr(plain, field), getattr(routed, field)), field
    assert (plain.reward, plain.finish_reason, plain.timings["turns"]) == \
        (routed.reward, routed.finish_reason, routed.timings["turns"])
    assert validate(plain, vocab_size=len(tok)) is None


def test_the_join_refuses_a_request_that_is_not_a_continuation():
    join = ExpertsJoin()
    join.add(np.zeros((6, LAYERS, TOP_K), np.int32))
    with pytest.raises(ValueError, match="not a continuation"):
        join.add(np.zeros((4, LAYERS, TOP_K), np.int32))
    join = ExpertsJoin()
    join.add(np.zeros((6, LAYERS, TOP_K), np.int32))
    join.add(None)                                   # one request without experts: none for the sample
    assert join.rows(6) is None
