"""The OpenAI-compatible chat client an agent talks to, recording exactly the tokens that were sampled.

An agent calls `await client.chat.completions.create(messages=..., tools=...)` as it would call
the OpenAI SDK's `AsyncOpenAI`; the reply has the SDK's shape (`choices[0].message.content`,
`.tool_calls[i].function.name/.arguments`, `finish_reason`, `usage`). Behind it, each call goes
to Tandem's own generation path (the same servers, sticky to one server per episode for its
prefix cache, interruptible, every token with its log-prob and policy version).

Why not re-render the conversation: re-tokenising a conversation through the chat template does
not give back the tokens that were sampled (Qwen3's template drops earlier `<think>` blocks,
tool calls come back with other whitespace, a tokenizer merges across a turn boundary), so a
trainer fed the re-rendered text computes log-probs of tokens the policy never produced. Here
the episode is one token sequence that only grows: the first call's prompt, then each
completion's sampled tokens as they were sampled (trained, `output_mask` 1), then what the
template puts between turns — the end of the assistant turn the model did not write itself,
tool results, user messages, the next generation prompt — as context (`output_mask` 0). Those
in-between tokens are the template's rendering of the new messages after a stand-in assistant
turn, so no earlier turn is ever rendered again. The price: an agent may only append messages
to its history; editing or dropping earlier ones is refused with an error (`AgentUsageError`).

Routing replay (MoE models): when the run records routing, every completion is a generation
request over the episode so far and comes back with the experts of every position it fed;
`routed` joins them as a multi-turn workflow's turns are joined (workflow.ExpertsJoin: each
position keeps the experts of the first completion that fed it, so the tokens between two
completions take the next one's prefill).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from .tool_calls import parse_tool_calls
from .workflow import ExpertsJoin


class AgentUsageError(ValueError):
    """The agent asked for something that could not be trained faithfully (see the message)."""


class EpisodeLimit(Exception):
    """The episode reached `rollout.max_turns` completions or its context limit. Raised by
    `create`; an agent may catch it and return a reward, else its episode ends with
    `rollout.agent_limit_reward`. `reason` is `turn_limit` or `context_limit`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---- the reply, shaped like the OpenAI SDK's ChatCompletion -----------------------------------
@dataclass
class Function:
    name: str
    arguments: str


@dataclass
class ToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatMessage:
    content: str | None
    tool_calls: list[ToolCall] | None = None
    role: str = "assistant"

    def model_dump(self, exclude_none: bool = False) -> dict:
        """The message as a dict to append to the history (the SDK's method of the same name)."""
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None} if exclude_none else out

    to_dict = model_dump


@dataclass
class Choice:
    message: ChatMessage
    finish_reason: str          # stop | length | tool_calls
    index: int = 0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    choices: list[Choice]
    usage: Usage
    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    object: str = "chat.completion"
    created: int = field(default_factory=lambda: int(time.time()))


# ---- messages --------------------------------------------------------------------------------
def normalize_message(message: Any, where: str) -> dict:
    """A history entry as a plain dict (SDK objects, our ChatMessage, dicts); text parts joined."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise AgentUsageError(f"{where} must be a message with a role, got {type(message).__name__}")
    out = {"role": message["role"]}
    content = message.get("content")
    if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise AgentUsageError(f"{where}: only text content parts are supported")
        content = "".join(p.get("text", "") for p in content)
    out["content"] = content or ""
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalize_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _normalize_call(call: Any, where: str) -> dict:
    if hasattr(call, "model_dump"):
        call = call.model_dump()
    try:
        fn = call["function"]
        args = fn["arguments"]
        return {"id": call.get("id", ""), "type": "function",
                "function": {"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args}}
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise AgentUsageError(f"{where} is not a tool call with function.name and JSON arguments ({e})") from None


def _same_reply(given: dict, returned: dict) -> bool:
    """Whether a history's assistant message is the reply we gave (its content and calls; the
    call ids may be dropped, what the model wrote may not be changed)."""
    def calls(m):
        return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return given["role"] == "assistant" and given["content"] == returned["content"] and calls(given) == calls(returned)


# ---- the template's tokens between turns -------------------------------------------------------
# A stand-in assistant turn the template renders before the new messages; its text is looked for
# in the rendering, and what follows it is what the template puts after an assistant turn.
_STAND_IN = "Tandem stand-in reply 7319"


def render(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    for i in range(start, len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


def between_turns(tokenizer, new_messages: list[dict], tools: list[dict] | None, sampled: list[int]) -> list[int]:
    """The tokens after a model turn whose tokens were `sampled`, up to the next generation prompt:
    the end of the assistant turn the model did not emit itself (e.g. an end-of-turn token it was
    cut before), `new_messages` as the template renders them, and the generation prompt.

    Rendered after a stand-in conversation (a user message, an assistant reply), never after the
    episode's own history, which the template might render otherwise than it was sampled."""
    base = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _STAND_IN}]
    full = render(tokenizer, base + new_messages, tools, add_generation_prompt=True)
    marker = tokenizer.encode(_STAND_IN, add_special_tokens=False)
    asked = render(tokenizer, base[:1], tools, add_generation_prompt=True)
    at = _find(full, marker, len(asked) if full[:len(asked)] == asked else 0)
    if at < 0:
        raise AgentUsageError("the chat template does not render an assistant reply as its own tokens; "
                              "an agent episode cannot be built on it")
    after = full[at + len(marker):]
    # What the model already emitted of the turn's end (its end-of-turn token) is not repeated.
    closing = min(len(after), 8)
    emitted = next((k for k in range(closing, 0, -1) if list(sampled[-k:]) == after[:k]), 0)
    return after[emitted:]


# ---- the client --------------------------------------------------------------------------------
# Request fields that change nothing here, accepted so SDK-style calls work unchanged.
_HARMLESS = {"model", "stream", "n", "user", "metadata", "store", "parallel_tool_calls", "extra_body", "seed"}


@dataclass
class Segment:
    """One stretch of the episode's tokens: a completion's (sampled) or the template's (context)."""
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    sampled: bool


class AgentClient:
    """`client.chat.completions.create(...)` for one episode; `client.segments` is what it sampled.

    `generate(prompt_ids, params, sticky_key)` is the worker's generation path; `sampling` the
    run's settings (temperature, top_p, top_k, max_new_tokens); `max_turns` and `max_context`
    bound the episode; `tool_format` is how tool calls are written (rollout/tool_calls.py)."""

    def __init__(self, generate, tokenizer, sampling: dict, sticky_key: str, max_turns: int, max_context: int,
                 tool_format: str, grade=None, run=None, model_name: str = "policy"):
        self._generate, self._tok, self._sampling = generate, tokenizer, sampling
        self._key, self._max_turns, self._max_context = sticky_key, max_turns, max_context
        self._format, self._grade, self._run, self._model = tool_format, grade, run, model_name
        self.prompt_ids: list[int] | None = None
        self.segments: list[Segment] = []
        self.routed = ExpertsJoin()        # the completions' routed experts (routing replay), joined
        self.history: list[dict] = []      # the conversation as of the last reply, normalized
        self.tools: list[dict] | None = None
        self.finish_reason = ""
        self.completions = 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def length(self) -> int:
        return len(self.prompt_ids or []) + sum(len(s.ids) for s in self.segments)

    async def grade(self, response: str, *, answer: str | None = None, tests: dict | None = None):
        """The run's own grader (reward.task, reward.function) on `response` for this episode's
        problem: a Verdict (reward, correct, details). `answer` / `tests` grade against another
        reference than the row's (e.g. the visible examples a code environment runs)."""
        if self._grade is None:
            raise AgentUsageError("this client has no grader")
        reference = {k: v for k, v in (("answer", answer), ("tests", tests)) if v is not None}
        return await self._grade(response, **reference)

    async def run_code(self, program: str, stdin: str = ""):
        """Run a Python program in the reward service's code sandbox (never in this worker): a
        Verdict whose details hold `status` ("ok" or why it stopped), `stdout` (its first 4,000
        characters) and `stderr` (its tail). For code tools: `agent_tools.sandboxed_python`."""
        if self._run is None:
            raise AgentUsageError("this client has no sandbox")
        return await self._run(program, stdin)

    def _check_settings(self, temperature, top_p, extra: dict) -> None:
        # Greedy (held-out evaluation, `tandem eval`): the run's greedy settings replace the agent's.
        greedy = self._sampling["temperature"] == 0
        for name, value in (("temperature", temperature), ("top_p", top_p)) if not greedy else ():
            if value is not None and float(value) != float(self._sampling[name]):
                raise AgentUsageError(
                    f"{name}={value} differs from rollout.{name}={self._sampling[name]}: the trainer computes the "
                    f"log-probs of sampled tokens with rollout.{name}, so a completion sampled otherwise would be "
                    f"trained with the wrong ratios; leave {name} out or set rollout.{name}")
        if extra.get("n", 1) != 1:
            raise AgentUsageError("n must be 1: an episode is one conversation (the group's samples are episodes)")
        if extra.get("stream"):
            raise AgentUsageError("stream=True is not supported; the reply comes whole")
        unknown = sorted(set(extra) - _HARMLESS)
        if unknown:
            raise AgentUsageError(f"unsupported create() arguments {unknown}: supported are messages, tools, "
                                  f"tool_choice, temperature, top_p, max_tokens (max_completion_tokens)")

    def _next_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The token ids to continue from: the first prompt, or the episode so far plus the new messages."""
        if self.prompt_ids is None:
            if messages[-1]["role"] == "assistant":
                raise AgentUsageError("the messages end with an assistant message; the model writes the next one")
            self.tools = tools
            self.prompt_ids = render(self._tok, messages, tools, add_generation_prompt=True)
            return list(self.prompt_ids)
        if tools != self.tools:
            raise AgentUsageError("tools changed within an episode: the template renders them once, at its start; "
                                  "pass the same tools to every call")
        n = len(self.history)
        for k, (given, had) in enumerate(zip(messages, self.history, strict=False)):
            same = _same_reply(given, had) if had["role"] == "assistant" and had.get("_reply") else given == had
            if not same:
                raise AgentUsageError(
                    f"messages[{k}] ({given['role']}) is not what the episode had there: Tandem continues an episode "
                    f"from the tokens it sampled, so earlier messages cannot be edited, reordered or dropped; "
                    f"append new ones (tool results, user turns) after the model's reply")
        new = messages[n:]
        if len(messages) < n or not new:
            raise AgentUsageError("no new message after the model's last reply: append the tool results or a "
                                  "user turn before asking again")
        last = next(s for s in reversed(self.segments) if s.sampled)
        env = between_turns(self._tok, new, tools, last.ids)
        self.segments.append(Segment(env, [0.0] * len(env), [last.versions[-1] if last.versions else 0] * len(env),
                                     sampled=False))
        return list(self.prompt_ids) + [t for s in self.segments for t in s.ids]

    async def create(self, *, messages: list, tools: list | None = None, tool_choice: Any = None,
                     temperature: float | None = None, top_p: float | None = None, max_tokens: int | None = None,
                     max_completion_tokens: int | None = None, **extra) -> ChatCompletion:
        self._check_settings(temperature, top_p, extra)
        if tool_choice not in (None, "auto", "none"):
            raise AgentUsageError(f"tool_choice={tool_choice!r} is not supported (no constrained decoding); "
                                  f"use 'auto' or 'none'")
        if not messages:
            raise AgentUsageError("messages is empty")
        msgs = [normalize_message(m, f"messages[{k}]") for k, m in enumerate(messages)]
        tools = [t.model_dump() if hasattr(t, "model_dump") else t for t in tools] if tools else None
        if self.completions >= self._max_turns:
            raise EpisodeLimit("turn_limit", f"the episode has had rollout.max_turns={self._max_turns} completions")
        prompt = self._next_prompt(msgs, tools)
        room = self._max_context - len(prompt)
        if room < 1:
            raise EpisodeLimit("context_limit", f"the episode's {len(prompt)} tokens reached its context limit "
                                                f"({self._max_context}, rollout.agent_context_tokens)")
        wanted = max_completion_tokens or max_tokens or self._sampling["max_new_tokens"]
        params = {**self._sampling, "max_new_tokens": max(1, min(int(wanted), self._sampling["max_new_tokens"], room))}
        sample = await self._generate(prompt, params, self._key)
        ids = list(sample.output_ids)
        self.segments.append(Segment(ids, list(sample.output_logprobs), list(sample.output_versions), sampled=True))
        self.routed.add(getattr(sample, "routed_experts", None))
        self.completions += 1
        self.finish_reason = sample.finish_reason
        return self._reply(msgs, ids, sample.finish_reason, tools if tool_choice != "none" else None, len(prompt))

    def _reply(self, msgs: list[dict], ids: list[int], finish: str, tools, n_prompt: int) -> ChatCompletion:
        eos = self._tok.eos_token_id
        body = ids[:-1] if ids and finish == "stop" and ids[-1] == eos else ids
        # Tool calls may be written with special tokens (SGLang keeps them when tools are given).
        text = self._tok.decode(body, skip_special_tokens=not tools)
        calls = []
        if tools:
            text, parsed = parse_tool_calls(text, self._format, tools)
            calls = [ToolCall(id=f"call_{uuid.uuid4().hex[:9]}", function=Function(c.name, c.arguments))
                     for c in parsed]
        message = ChatMessage(content=text, tool_calls=calls or None)
        reply = normalize_message(message, "reply")
        self.history = msgs + [{**reply, "_reply": True}]
        # SGLang reports a parsed tool call as the finish reason `tool_calls`.
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        return ChatCompletion(choices=[Choice(message, reason)], model=self._model,
                              usage=Usage(n_prompt, len(ids), n_prompt + len(ids)))
