"""The episode: one admitted prompt group from prompt to graded trajectories.

It is a plain async function, selected by `rollout.workflow: module:function`, so a user can
write a custom or multi-turn workflow without touching the worker: it receives an
`EpisodeContext` (generation, grading, tokenizer, settings) and returns the group's
trajectories, or raises `RejectGroup` to drop the group on purpose (counted as a rejection).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tandem.services.protocol import GradeItem, Ticket, Trajectory, Verdict, import_user_module
from tandem.services.protocol.trajectory import compact_experts

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
    # Multi-turn workflows (rollout/code_feedback.py): turns per sample, the factor a correct
    # answer's reward is multiplied by per extra turn, characters of feedback shown per turn.
    max_turns: int = 1
    turn_discount: float = 1.0
    feedback_chars: int = 300


Workflow = Callable[[EpisodeContext, Prompt, Ticket], Awaitable[list[Trajectory]]]
DEFAULT_WORKFLOW = "tandem.rollout.workflow:single_turn"


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


def chat_prompt_ids(tokenizer, text: str | list[dict]) -> list[int]:
    """The prompt as token ids through the tokenizer's chat template (what the model was tuned on):
    one user message, or a whole conversation (a list of `{role, content}`) to be continued. A
    data set's problem is `prompt.messages()`: asked with the run's system prompt and template."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return _render(tokenizer, messages, add_generation_prompt=True)


def next_turn_ids(tokenizer, messages: list[dict], generated_ids: list[int]) -> list[int]:
    """The tokens the environment appends after the model's turn, so that the context reads as the
    chat template renders the conversation: the end of the assistant turn the model did not
    write itself (e.g. EOS when it was cut at max_new_tokens), the new user message and the
    generation prompt.

    `messages` ends with the assistant turn (its decoded text) and the new user message. The
    model's own tokens stay as they were sampled (their log-probs are the behaviour policy's);
    only the environment's part comes from the template, as the difference between the
    conversation rendered with and without the new message."""
    if len(messages) < 3 or messages[-2]["role"] != "assistant" or messages[-1]["role"] != "user":
        raise ValueError("next_turn_ids needs the conversation ending in an assistant turn and a new user turn")
    asked = _render(tokenizer, messages[:-2], add_generation_prompt=True)
    closed = _render(tokenizer, messages[:-1], add_generation_prompt=False)
    extended = _render(tokenizer, messages, add_generation_prompt=True)
    content = tokenizer.encode(messages[-2]["content"], add_special_tokens=False)
    if closed[:len(asked)] != asked or extended[:len(closed)] != closed \
            or closed[len(asked):len(asked) + len(content)] != content:
        raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                         "a multi-turn episode cannot be built on it")
    closing = closed[len(asked) + len(content):]   # what the template puts after the assistant's text
    emitted = next((k for k in range(len(closing), 0, -1) if list(generated_ids[-k:]) == closing[:k]), 0)
    return closing[emitted:] + extended[len(closed):]


class ExpertsJoin:
    """The routed experts (routing replay) of one token sequence fed to the model over several
    generation requests, each over the whole sequence so far: the turns of a multi-turn episode
    (rollout/code_feedback.py), an agent's completions (rollout/agent_client.py).

    Each request's experts cover every position it fed, from 0 (`GenerationResult.routed_experts`).
    A position keeps the experts of the first request that fed it, as the generation client joins
    an interrupted sample's segments: the tokens that request sampled were computed under that
    routing. A later request feeds it again (SGLang's radix cache returns the same routing; a
    recompute under newer weights may route it otherwise, and one record per position cannot hold
    both). Context tokens between two requests (feedback, tool results) are first fed by the next
    one. None as soon as one request came without experts (routing not recorded)."""

    def __init__(self):
        self.chunks: list[np.ndarray] | None = []
        self.covered = 0   # positions joined so far

    def add(self, experts) -> None:
        """One request's experts, [positions it fed, layers, top_k], or None."""
        if experts is None:
            self.chunks = None
        elif self.chunks is not None:
            if len(experts) < self.covered:
                raise ValueError(f"a request's routed experts cover {len(experts)} positions, fewer than the "
                                 f"{self.covered} an earlier request of the same sequence fed: not a continuation")
            self.chunks.append(np.asarray(experts)[self.covered:])
            self.covered = len(experts)

    def rows(self, positions: int) -> np.ndarray | None:
        """[positions, layers, top_k] for a trajectory (`positions` = prompt + output - 1), or None.
        Context tokens after the last request (an episode stopped after appending them) were never
        fed: they take the last fed position's experts, which no trained log-prob depends on
        (they come after every sampled token)."""
        if not self.chunks:
            return None
        if self.covered > positions:
            raise ValueError(f"routed experts of {self.covered} positions for a trajectory of {positions}")
        rows = np.concatenate(self.chunks, 0)
        if positions > len(rows):
            rows = np.concatenate([rows, np.repeat(rows[-1:], positions - len(rows), 0)], 0)
        return rows


def grade_item(prompt: Prompt, response: str) -> GradeItem:
    """The item the reward service grades. `row` carries what a user's reward function
    (reward.function) may need beyond the reference, which travels in its own field: the data
    set row's other columns, the id and the reference's other entries."""
    row = {**prompt.row, "id": prompt.id,
           **{k: v for k, v in prompt.reference.items() if k not in ("answer", "tests")}}
    if prompt.task == "math":
        return GradeItem(task="math", response=response, answer=prompt.reference["answer"], question=prompt.text,
                         row=row)
    return GradeItem(task="code", response=response, tests=prompt.reference["tests"], question=prompt.text, row=row)


async def single_turn(ctx: EpisodeContext, prompt: Prompt, ticket: Ticket) -> list[Trajectory]:
    """n samples of one prompt, graded together; the default workflow for math and code."""
    prompt_ids = chat_prompt_ids(ctx.tokenizer, prompt.messages())
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
        routed_experts=compact_experts(getattr(s, "routed_experts", None)),
        task=prompt.task, timings={"generate_s": t_gen, "grade_s": t_grade, "correct": float(v.correct),
                                   "hedged": float(bool(v.details.get("hedged"))),
                                   "limit_hit": float(bool(v.details.get("limit")))},
    ) for i, (s, v) in enumerate(zip(samples, verdicts, strict=True))]


def import_function(spec: str):
    """`module:function` of the user's code → the function; a ValueError says what is wrong."""
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"must look like 'module:function', got {spec!r}")
    try:
        module = import_user_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {fn_name!r}")
    return fn


def load_workflow(spec: str) -> Workflow:
    """`module:function` → the function, with an error that says what is wrong."""
    try:
        return import_function(spec)
    except ValueError as e:
        raise ValueError(f"rollout.workflow {spec!r}: {e}") from None
