"""Train any agent: the user's async function, its episodes, and the trajectories made of them.

An agent is one async function, selected by `rollout.agent: module:function`:

    async def solve(row: dict, client) -> float | AgentResult

`row` is the data set row (its columns, plus `prompt`, `messages` — the problem with the run's
system prompt and template — `id`, and the reference: `answer` or `tests`); `client` is an
OpenAI-compatible async client (`await client.chat.completions.create(messages=..., tools=...)`,
rollout/agent_client.py) whose every completion is recorded token for token, and
`await client.grade(text)` grades a text with the run's own reward. The agent runs its
environment and tools (rollout/agent_tools.py: timeouts, caps, errors the model sees) and
returns the episode's reward, or an `AgentResult` with per-turn rewards and details.

The workflow below runs `rollout.n_samples` episodes of the same row (a GRPO group), each sticky
to one generation server, and turns each into one trajectory: the first prompt, then the
completions' sampled tokens (trained) and the template's tokens between them (context only);
with routing recorded (trainer.routing_replay, routing_agreement), the completions' routed
experts joined over the whole episode (agent_client.py). An episode that reaches
`rollout.max_turns` completions, its context limit (`rollout.agent_context_tokens`) or
`rollout.agent_timeout_s` ends there with `rollout.agent_limit_reward`, keeping the tokens it
has; an agent that raises fails its group (visibly: the reason reaches the progress output and
the audit).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.services.protocol import GradeItem, Ticket, Trajectory
from tandem.services.protocol.trajectory import compact_experts

from .agent_client import AgentClient, AgentUsageError, EpisodeLimit
from .agent_tools import ToolFailed
from .dataset import Prompt
from .tool_calls import detect_format
from .workflow import EpisodeContext, RejectGroup, grade_item, import_function, load_workflow

AGENT_WORKFLOW = "tandem.rollout.agent:agent_episodes"


@dataclass
class AgentResult:
    """What an agent may return instead of a bare reward. `correct` defaults to reward > 0;
    `turn_rewards` (one per completion) lets the trainer credit each turn with its own
    (trainer.turn_credit); `details` go to the run's records."""
    reward: float
    correct: bool | None = None
    turn_rewards: list[float] | None = None
    details: dict = field(default_factory=dict)


@dataclass
class AgentSettings:
    """The run's settings for agent episodes (from the `rollout` and `reward` config sections)."""
    agent: object                       # the user's function
    max_turns: int
    context_tokens: int
    timeout_s: float
    limit_reward: float
    tool_format: str = ""


class AgentError(ValueError):
    """`rollout.agent` cannot be used: it does not import, or is not an async function of (row, client)."""


def load_agent(spec: str):
    """`module:function` → the async function, or an AgentError saying what is wrong."""
    try:
        fn = import_function(spec)
    except ValueError as e:
        raise AgentError(str(e)) from None
    fn_name = spec.partition(":")[2]
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"{spec} must be an async function (async def {fn_name}(row, client))")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise AgentError(f"{spec} must take two arguments, (row, client)") from None
    return fn


def agent_workflow(cfg):
    """The episode function for a run with `rollout.agent` set: the agent workflow, bound to it."""
    rc = cfg.rollout
    settings = AgentSettings(agent=load_agent(rc.agent), max_turns=rc.max_turns,
                             context_tokens=agent_context_tokens(rc), timeout_s=rc.agent_timeout_s,
                             limit_reward=cfg.reward.wrong_reward if rc.agent_limit_reward is None
                             else rc.agent_limit_reward, tool_format=rc.tool_call_format)
    return functools.partial(agent_episodes, settings=settings)


def episode_function(cfg):
    """What a worker runs per ticket: the agent workflow when rollout.agent is set, else rollout.workflow."""
    return agent_workflow(cfg) if cfg.rollout.agent else load_workflow(cfg.rollout.workflow)


def agent_context_tokens(rc) -> int:
    """An episode's token limit: rollout.agent_context_tokens, or (0) the first prompt's limit
    plus every turn's new tokens."""
    return rc.agent_context_tokens or rc.max_prompt_tokens + rc.max_turns * rc.max_new_tokens


def agent_row(prompt: Prompt) -> dict:
    """The row an agent receives: its columns, the problem as asked, and the reference."""
    return {**prompt.row, **prompt.reference, "id": prompt.id, "prompt": prompt.text, "task": prompt.task,
            "messages": prompt.messages()}


def tool_format(tokenizer, configured: str) -> str:
    """rollout.tool_call_format, or the format the model's chat template teaches (hermes if none)."""
    return configured or detect_format(getattr(tokenizer, "chat_template", None)) or "hermes"


async def _episode(ctx: EpisodeContext, settings: AgentSettings, prompt: Prompt, key: str):
    async def grade(text: str, **reference):
        item = grade_item(prompt, text)
        for field_name, value in reference.items():   # the agent's own reference: e.g. the tests it shows
            setattr(item, field_name, value)
        return (await ctx.grade([item]))[0]

    async def run(program: str, stdin: str):
        return (await ctx.grade([GradeItem(task="run", response=program, answer=stdin)]))[0]

    client = AgentClient(ctx.generate, ctx.tokenizer, ctx.sampling_params, key, settings.max_turns,
                         settings.context_tokens, tool_format(ctx.tokenizer, settings.tool_format), grade=grade, run=run)
    try:
        result = await asyncio.wait_for(settings.agent(agent_row(prompt), client), timeout=settings.timeout_s)
        ended = client.finish_reason
    except EpisodeLimit as e:
        result, ended = AgentResult(settings.limit_reward, details={"ended": e.reason}), e.reason
    except ToolFailed as e:
        result, ended = AgentResult(settings.limit_reward, details={"ended": "tool_error", "error": str(e)}), "tool_error"
    except TimeoutError:
        result, ended = AgentResult(settings.limit_reward, details={"ended": "timeout"}), "timeout"
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        result = AgentResult(float(result))
    if not isinstance(result, AgentResult):
        raise AgentUsageError(f"the agent returned {type(result).__name__}; return a reward (float) or an AgentResult")
    if not any(s.sampled for s in client.segments):
        if ended == "context_limit":   # the first prompt alone: a problem too long for this run
            raise RejectGroup(f"the first prompt ({client.length()} tokens) leaves no room under the episode's "
                              f"context limit ({settings.context_tokens})")
        raise AgentUsageError("the agent ended its episode without asking the model anything: nothing to train")
    return client, result, ended


def _trajectory(ctx, ticket: Ticket, i: int, client: AgentClient, result: AgentResult, ended: str,
                elapsed: float, prompt_task: str) -> Trajectory:
    segments = list(client.segments)
    while not segments[-1].sampled:   # asked again but stopped before the reply: no reply to train
        segments.pop()
    ids, logprobs, versions, mask = [], [], [], []
    for s in segments:
        ids += s.ids
        logprobs += s.logprobs
        versions += s.versions
        mask += [int(s.sampled)] * len(s.ids)
    turns = client.completions
    turn_rewards = result.turn_rewards
    if turn_rewards is not None and len(turn_rewards) != turns:
        raise AgentUsageError(f"turn_rewards has {len(turn_rewards)} entries for {turns} completions")
    correct = result.correct if result.correct is not None else result.reward > 0
    return Trajectory(
        group_id=ticket.group_id, sample_idx=i, group_size=ctx.n_samples,
        prompt_ids=np.asarray(client.prompt_ids, dtype=np.int32),
        output_ids=np.asarray(ids, dtype=np.int32), output_logprobs=np.asarray(logprobs, dtype=np.float32),
        output_versions=np.asarray(versions, dtype=np.int32), output_mask=np.asarray(mask, dtype=np.uint8),
        turn_rewards=None if turn_rewards is None else np.asarray(turn_rewards, dtype=np.float32),
        routed_experts=compact_experts(client.routed.rows(len(client.prompt_ids) + len(ids) - 1)),
        admit_version=ticket.admit_version, reward=float(result.reward), finish_reason=ended or "stop",
        task=prompt_task, timings={"episode_s": elapsed, "correct": float(bool(correct)), "turns": float(turns),
                               **{k: float(v) for k, v in result.details.items() if isinstance(v, (int, float))}})


async def agent_episodes(ctx: EpisodeContext, prompt: Prompt, ticket: Ticket, *,
                         settings: AgentSettings) -> list[Trajectory]:
    """n episodes of one row, each one trajectory (see the module's docstring)."""
    t0 = time.time()
    episodes = await asyncio.gather(*[_episode(ctx, settings, prompt, f"{ticket.group_id}/{i}")
                                      for i in range(ctx.n_samples)])
    elapsed = time.time() - t0
    rewards = [r.reward for _, r, _ in episodes]
    if ctx.filter_all_equal and len(set(rewards)) == 1:
        raise RejectGroup(f"all {len(rewards)} episodes got reward {rewards[0]}")
    return [_trajectory(ctx, ticket, i, c, r, ended, elapsed, prompt.task) for i, (c, r, ended) in enumerate(episodes)]
