"""The episode: one admitted prompt group from prompt to graded trajectories.

It is a plain async function, selected by `rollout.workflow: module:function`, so a user can
write a custom or multi-turn workflow without touching the worker: it receives an
`EpisodeContext` (generation, grading, tokenizer, settings) and returns the group's
trajectories, or raises `RejectGroup` to drop the group on purpose (counted as a rejection).
"""
from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from services.protocol import GradeItem, Ticket, Trajectory, Verdict

from .dataset import Prompt


class RejectGroup(Exception):
    """The workflow decided not to train this group (e.g. every sample got the same reward)."""


class Sample(Protocol):
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str


@dataclass
class EpisodeContext:
    # generate(prompt_ids, sampling_params, sticky_key) -> one Sample (interruptions resolved)
    generate: Callable[[list[int], dict, str], Awaitable[Sample]]
    # grade(items) -> one verdict per item
    grade: Callable[[list[GradeItem]], Awaitable[list[Verdict]]]
    tokenizer: Any
    n_samples: int
    sampling_params: dict
    filter_all_equal: bool = False


Workflow = Callable[[EpisodeContext, Prompt, Ticket], Awaitable[list[Trajectory]]]


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as token ids through the tokenizer's chat template (what the model was tuned on)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


def grade_item(prompt: Prompt, response: str) -> GradeItem:
    if prompt.task == "math":
        return GradeItem(task="math", response=response, answer=prompt.reference["answer"], question=prompt.text)
    return GradeItem(task="code", response=response, tests=prompt.reference["tests"])


async def single_turn(ctx: EpisodeContext, prompt: Prompt, ticket: Ticket) -> list[Trajectory]:
    """n samples of one prompt, graded together; the default workflow for math and code."""
    prompt_ids = chat_prompt_ids(ctx.tokenizer, prompt.text)
    t0 = time.time()
    samples = await asyncio.gather(*[
        ctx.generate(prompt_ids, ctx.sampling_params, f"{ticket.group_id}/{i}") for i in range(ctx.n_samples)])
    t_gen = time.time() - t0
    responses = [ctx.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
    verdicts = await ctx.grade([grade_item(prompt, r) for r in responses])
    t_grade = time.time() - t0 - t_gen
    rewards = [v.reward for v in verdicts]
    if ctx.filter_all_equal and len(set(rewards)) == 1:
        raise RejectGroup(f"all {len(rewards)} samples got reward {rewards[0]}")
    return [Trajectory(
        group_id=ticket.group_id, sample_idx=i, group_size=ctx.n_samples,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        output_ids=np.asarray(s.output_ids, dtype=np.int32),
        output_logprobs=np.asarray(s.output_logprobs, dtype=np.float32),
        output_versions=np.asarray(s.output_versions, dtype=np.int32),
        admit_version=ticket.admit_version, reward=float(v.reward), finish_reason=s.finish_reason,
        task=prompt.task, timings={"generate_s": t_gen, "grade_s": t_grade, "correct": float(v.correct),
                                   "hedged": float(bool(v.details.get("hedged"))),
                                   "limit_hit": float(bool(v.details.get("limit")))},
    ) for i, (s, v) in enumerate(zip(samples, verdicts, strict=True))]


def load_workflow(spec: str) -> Workflow:
    """`module:function` → the function, with an error that says what is wrong."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"rollout.workflow must look like 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.workflow {spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"rollout.workflow {spec!r}: {module_name} has no function {fn_name!r}")
    return fn
