"""The agent API reproduces a hand-written multi-turn workflow token for token: the code agent
written against the OpenAI-compatible client (rollout/agents/code_feedback.py) and the built-in
workflow it mirrors (rollout/code_feedback.py) give identical trajectories on the same samples.

The model is a stand-in (scripted programs, log-probs and versions) and so is the grader (a
verdict chosen from the program's text, with the per-test records the feedback reads); the
tokenizer and chat template are the tiny model's, real. Equal trajectories mean the client's
between-turn tokens equal the workflow's `next_turn_ids`, derived independently from the template.
With routing recorded (each request returning the experts of every position it fed), the two join
them into the same `routed_experts`; without, neither has any.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

import numpy as np
import pytest

from tandem.rollout.agent import AgentSettings, agent_episodes
from tandem.rollout.agents.code_feedback import solve
from tandem.rollout.code_feedback import code_with_feedback
from tandem.rollout.dataset import Prompt
from tandem.rollout.synthetic import code_problem
from tandem.rollout.workflow import EpisodeContext
from tandem.services.protocol import Ticket, Verdict

WRONG, RIGHT = "```python\ndef f(x): return x\n```", "```python\ndef f(x): return 2*x+1\n```"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@dataclass
class Sampled:
    output_ids: list
    output_logprobs: list
    output_versions: list
    finish_reason: str
    routed_experts: np.ndarray | None = None


def scripted(tok, programs: dict[str, list[str]], routed: bool = False):
    """Each sample (its sticky key) writes its programs in turn; versions rise by turn. With
    `routed`, turn k routes every position p it fed to experts [[k, p], [p, k]]."""
    turns: dict[str, int] = {}

    async def generate(prompt_ids, params, key):
        k = turns.get(key, 0)
        turns[key] = k + 1
        ids = tok.encode(programs[key.split("/")[-1]][k], add_special_tokens=False) + [tok.eos_token_id]
        rng = np.random.default_rng(abs(hash((key, k))) % 2**32)
        p = np.arange(len(prompt_ids) + len(ids) - 1)
        experts = np.stack([np.stack([np.full_like(p, k), p], 1), np.stack([p, np.full_like(p, k)], 1)], 1)
        return Sampled(ids, list(-rng.random(len(ids))), [k] * (len(ids) - 2) + [k + 1] * 2, "stop",
                       experts if routed else None)
    return generate


async def grade(items):
    out = []
    for item in items:
        right = "2*x+1" in item.response
        records = [{"passed": right, "status": "passed" if right else "wrong output", "got": "1"}
                   for _ in item.tests["inputs"]]
        out.append(Verdict(reward=1.0 if right else -1.0, correct=right, details={"tests": records}))
    return out


@pytest.mark.parametrize("routed", [False, True])
def test_the_code_agent_gives_the_workflows_trajectories(tok, routed):
    import random
    row = code_problem(random.Random(3))
    prompt = Prompt(id="c1", text=row["problem"], task="code",
                    reference={"tests": row["tests"], "visible_tests": row["visible_tests"]})
    programs = {"0": [RIGHT], "1": [WRONG, RIGHT], "2": [WRONG, WRONG, WRONG]}

    def ctx():
        return EpisodeContext(generate=scripted(tok, programs, routed), grade=grade, tokenizer=tok, n_samples=3,
                              sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64},
                              max_turns=3)

    ticket = Ticket(group_id="g", admit_version=2)
    workflow = asyncio.run(code_with_feedback(ctx(), prompt, ticket))
    settings = AgentSettings(agent=solve, max_turns=3, context_tokens=100_000, timeout_s=30, limit_reward=-1.0)
    agent = asyncio.run(functools.partial(agent_episodes, settings=settings)(ctx(), prompt, ticket))

    assert [t.timings["turns"] for t in agent] == [1.0, 2.0, 3.0]
    for w, a in zip(workflow, agent, strict=True):
        for field in ("prompt_ids", "output_ids", "output_logprobs", "output_versions", "output_mask", "turn_rewards"):
            assert np.array_equal(getattr(w, field), getattr(a, field)), field
        if routed:   # each turn first fed the feedback before it and its own tokens: every turn has rows
            assert np.array_equal(w.routed_experts, a.routed_experts) and w.routed_experts.dtype == a.routed_experts.dtype
            assert len(a.routed_experts) == len(a.prompt_ids) + len(a.output_ids) - 1
            assert set(a.routed_experts[:, 0, 0].tolist()) == set(range(int(a.timings["turns"])))
        else:
            assert w.routed_experts is None and a.routed_experts is None
        assert (w.reward, w.finish_reason, w.timings["first_turn_correct"]) == \
            (a.reward, a.finish_reason, a.timings["first_turn_correct"])
    assert np.any(agent[1].output_mask == 0)   # the feedback turn is context
