"""A multi-turn code episode: write a program, see it fail on the visible examples, revise.

`rollout.workflow: tandem.rollout.code_feedback:code_with_feedback`. Each of the group's n samples is a
conversation of up to `rollout.max_turns` model turns. After a turn, the reward service runs the
program once, on the problem's *visible* tests (`visible_tests` of its row) followed by its
hidden ones (`tests`, those already visible left out). If a visible test fails, its input, the
expected and the actual result (cut to `rollout.feedback_chars`) come back as the next user
turn; nothing of the hidden tests ever does. The episode ends when the visible tests pass or
the turns run out; the reward is the last program's verdict on all of them (times
`turn_discount` per extra turn when it is right), so passing the visible examples alone never
pays. Each turn's program gets its own reward the same way (`turn_rewards`): the trainer
credits every turn with its own (trainer.turn_credit), so a wrong first program is not
reinforced because feedback rescued it. One sandbox run per turn gives the feedback, the
rewards and the first turn's pass rate.

What reaches the trainer is one trajectory per sample: the first prompt, then every model turn
and the environment's tokens between them. The environment's tokens are context only
(`output_mask` 0: never trained, log-prob 0); every model token keeps the behaviour log-prob and
policy version it was sampled with, so the decoupled loss stays exact when weights change
between turns (or inside one). Turn boundaries are the chat template's (`next_turn_ids`).
A problem without visible tests is a single-turn episode.
"""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from tandem.services.protocol import GradeItem, Ticket, Trajectory, Verdict
from tandem.services.protocol.trajectory import compact_experts

from .dataset import Prompt
from .workflow import EpisodeContext, ExpertsJoin, RejectGroup, chat_prompt_ids, next_turn_ids

log = logging.getLogger(__name__)
_single_turn_warned = False


def describe_failure(fn_name: str | None, args, got: str | None, expected, status: str = "wrong output") -> str:
    """One failed visible test as the model reads it (the warm-up's examples use it too)."""
    if fn_name:
        call = f"{fn_name}({', '.join(repr(a) for a in args)})"
        result = f"returned {got}" if status == "wrong output" else status
        return f"Test failed: {call} {result}, expected {expected!r}. Fix {fn_name}."
    result = f"printed {got!r}" if status == "wrong output" else status
    return f"Test failed on input {str(args)!r}: your program {result}, expected {str(expected)!r}."


def visible_passed(check: Verdict, n_visible: int) -> bool:
    """Whether the program passed the first `n_visible` tests of its run (the visible ones)."""
    records = check.details.get("tests") or []
    return len(records) >= n_visible and all(r.get("passed") for r in records[:n_visible])


def feedback_message(visible: dict, check: Verdict, limit: int) -> str:
    """The user turn after a failed attempt: the first failing visible test, cut to `limit`.
    `check` is the run on the visible tests followed by hidden ones: only the visible records
    (the first `len(visible["inputs"])`) are read."""
    details = check.details
    records = (details.get("tests") or [])[:len(visible["inputs"])]
    failing = next((k for k, r in enumerate(records) if not r.get("passed")), None)
    if failing is None:   # no program, or the sandbox refused it: say why (no test ran)
        text = f"Your answer was not accepted: {details.get('reason', 'no program found')}. Fix it."
    else:
        rec = records[failing]
        text = describe_failure(visible.get("fn_name"), visible["inputs"][failing], rec.get("got"),
                                visible["outputs"][failing], rec.get("status", "failed"))
    return text if len(text) <= limit else text[:limit - 3] + "..."


MAX_VISIBLE = 20   # visible tests used for feedback: the verdict keeps the first 20 records


def checked_tests(visible: dict | None, hidden: dict) -> tuple[dict, int]:
    """The tests of one turn's run, visible first, and how many are visible. Hidden tests that
    repeat a visible one are left out (the synthetic task's and LiveCodeBench's hidden tests
    include the shown examples)."""
    if not visible:
        return hidden, 0
    if visible.get("fn_name") != hidden.get("fn_name") or \
            visible.get("convention", "tandem") != hidden.get("convention", "tandem"):
        raise ValueError("visible_tests and tests must call the same function under the same convention")
    shown = list(zip(visible["inputs"], visible["outputs"], strict=True))[:MAX_VISIBLE]
    rest = [(i, o) for i, o in zip(hidden["inputs"], hidden["outputs"], strict=True) if (i, o) not in shown]
    merged = {**hidden, "inputs": [i for i, _ in shown + rest], "outputs": [o for _, o in shown + rest]}
    return merged, len(shown)


class _Conversation:
    """One sample's tokens so far: model turns (mask 1) and environment turns (mask 0)."""

    def __init__(self, messages: list[dict]):
        self.messages = list(messages)      # the problem as asked: system prompt, templated question
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.verdicts: list[Verdict] = []   # each turn's program on every test
        # Routed experts (routing replay): each turn's request covers every position it fed; a
        # position keeps the experts of the first turn that fed it (workflow.ExpertsJoin).
        self.routed = ExpertsJoin()
        self.finish_reason = "stop"

    def add_model_turn(self, sample, text: str) -> None:
        self.routed.add(getattr(sample, "routed_experts", None))
        self.ids += list(sample.output_ids)
        self.logprobs += list(sample.output_logprobs)
        self.versions += list(sample.output_versions)
        self.mask += [1] * len(sample.output_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.finish_reason = sample.finish_reason

    def experts(self, prompt_len: int) -> np.ndarray | None:
        """[prompt + output - 1, layers, k] for the trajectory (environment tokens after the last
        model turn take the last fed position's experts: ExpertsJoin.rows)."""
        return self.routed.rows(prompt_len + len(self.ids) - 1)

    def add_environment_turn(self, tokenizer, text: str, last_model_ids: list[int]) -> None:
        self.messages.append({"role": "user", "content": text})
        env = next_turn_ids(tokenizer, self.messages, last_model_ids)
        self.ids += env
        self.logprobs += [0.0] * len(env)
        self.versions += [self.versions[-1] if self.versions else 0] * len(env)
        self.mask += [0] * len(env)


async def _sample(ctx: EpisodeContext, prompt: Prompt, prompt_ids: list[int], key: str, limit: int,
                  tests: dict, n_visible: int) -> _Conversation:
    conv = _Conversation(prompt.messages())
    visible = prompt.reference.get("visible_tests")
    turns = ctx.max_turns if n_visible else 1
    for turn in range(turns):
        params = dict(ctx.sampling_params)
        if turn and limit:   # the context grows with each turn; never past the model's window
            room = limit - len(prompt_ids) - len(conv.ids)
            if room < 8:
                break
            params["max_new_tokens"] = min(params["max_new_tokens"], room)
        sample = await ctx.generate(prompt_ids + conv.ids, params, key)
        text = ctx.tokenizer.decode(sample.output_ids, skip_special_tokens=True)
        conv.add_model_turn(sample, text)
        check = (await ctx.grade([GradeItem(task="code", response=text, tests=tests)]))[0]
        conv.verdicts.append(check)
        if turn == turns - 1 or visible_passed(check, n_visible):
            break
        conv.add_environment_turn(ctx.tokenizer, feedback_message(visible, check, ctx.feedback_chars),
                                  list(sample.output_ids))
    return conv


async def code_with_feedback(ctx: EpisodeContext, prompt: Prompt, ticket: Ticket) -> list[Trajectory]:
    """n conversations of one problem; each rewarded by its last program's verdict."""
    if prompt.task != "code":
        raise ValueError(f"code_with_feedback needs code problems, got task {prompt.task!r}")
    global _single_turn_warned
    tests, n_visible = checked_tests(prompt.reference.get("visible_tests"), prompt.reference["tests"])
    if not n_visible and ctx.max_turns > 1 and not _single_turn_warned:
        _single_turn_warned = True
        log.warning("problem %s has no visible_tests: its episodes are single-turn (no feedback to give); "
                    "rows need a visible_tests field, or LiveCodeBench public tests", prompt.id)
    prompt_ids = chat_prompt_ids(ctx.tokenizer, prompt.messages())
    limit = int(getattr(ctx.tokenizer, "model_max_length", 0) or 0)
    limit = limit if 0 < limit < 1_000_000 else 0
    t0 = time.time()
    convs = await asyncio.gather(*[_sample(ctx, prompt, prompt_ids, f"{ticket.group_id}/{i}", limit, tests, n_visible)
                                   for i in range(ctx.n_samples)])
    elapsed = time.time() - t0
    final = [c.verdicts[-1] for c in convs]
    turn_rewards = [[v.reward * ctx.turn_discount ** k if v.correct else v.reward for k, v in enumerate(c.verdicts)]
                    for c in convs]
    rewards = [t[-1] for t in turn_rewards]
    if ctx.filter_all_equal and len(set(rewards)) == 1:
        raise RejectGroup(f"all {len(rewards)} samples got reward {rewards[0]}")
    return [Trajectory(
        group_id=ticket.group_id, sample_idx=i, group_size=ctx.n_samples,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        output_ids=np.asarray(c.ids, dtype=np.int32),
        output_logprobs=np.asarray(c.logprobs, dtype=np.float32),
        output_versions=np.asarray(c.versions, dtype=np.int32),
        output_mask=np.asarray(c.mask, dtype=np.uint8), turn_rewards=np.asarray(tr, dtype=np.float32),
        routed_experts=compact_experts(c.experts(len(prompt_ids))),
        admit_version=ticket.admit_version, reward=float(r), finish_reason=c.finish_reason, task=prompt.task,
        # generation and grading interleave turn by turn: `episode_s` is both
        timings={"episode_s": elapsed, "correct": float(v.correct), "turns": float(len(c.verdicts)),
                 "first_turn_correct": float(c.verdicts[0].correct),
                 "hedged": float(bool(v.details.get("hedged"))), "limit_hit": float(bool(v.details.get("limit")))},
    ) for i, (c, v, r, tr) in enumerate(zip(convs, final, rewards, turn_rewards, strict=True))]
