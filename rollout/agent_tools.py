"""Tools for agents, made safe to call from an RL episode: a tool that raises, hangs or floods
costs its turn (the model reads the error), never the worker.

    tools = Toolbox(calculator, search, timeout_s=5, max_chars=2000)
    reply = await client.chat.completions.create(messages=messages, tools=tools.schemas)
    messages += [reply.choices[0].message.model_dump(), *await tools.run_all(reply.choices[0].message)]

Each tool is a Python function with type hints and a Google-style docstring (its JSON schema is
built by transformers' `get_json_schema`, the format chat templates render), sync or async.
An error, a timeout or an unknown tool becomes the tool message's content (`error: ...`), as
the model should learn to recover from it; with `on_error="episode"` it ends the episode
instead (`ToolFailed`, rewarded like an episode limit). Output past `max_chars` is cut and says
so. A sync tool runs in a thread of its own pool: after a timeout that thread may keep running
(Python cannot kill a thread), so tools that can hang should be async or run their work in a
subprocess — code the model wrote belongs in the reward sandbox, never in the worker.
"""
from __future__ import annotations

import asyncio
import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ToolFailed(Exception):
    """A tool failed and the Toolbox was told to end the episode (on_error="episode")."""


class Toolbox:
    def __init__(self, *functions, timeout_s: float = 10.0, max_chars: int = 2000, on_error: str = "turn",
                 threads: int = 16):
        if on_error not in ("turn", "episode"):
            raise ValueError(f"on_error must be 'turn' or 'episode', got {on_error!r}")
        from transformers.utils import get_json_schema

        self.functions = {f.__name__: f for f in functions}
        self.schemas = [get_json_schema(f) for f in functions]   # {"type": "function", "function": {...}}
        self.timeout_s, self.max_chars, self.on_error = timeout_s, max_chars, on_error
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-tool")

    async def call(self, name: str, arguments: str | dict) -> str:
        """The tool's output as the text the model reads; failures as `error: ...`."""
        try:
            return self._cut(await self._invoke(name, arguments))
        except ToolFailed:
            raise
        except Exception as e:
            message = f"error: {e}" if isinstance(e, _ToolError) else f"error: {type(e).__name__}: {e}"
            if self.on_error == "episode":
                raise ToolFailed(f"tool {name!r}: {message}") from None
            return self._cut(message)

    async def run(self, tool_call) -> dict:
        """The tool message answering one of a reply's `tool_calls`."""
        fn = tool_call.function if hasattr(tool_call, "function") else tool_call["function"]
        name, args = (fn.name, fn.arguments) if hasattr(fn, "name") else (fn["name"], fn["arguments"])
        call_id = tool_call.id if hasattr(tool_call, "id") else tool_call.get("id", "")
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": await self.call(name, args)}

    async def run_all(self, message) -> list[dict]:
        """Tool messages for every call of an assistant message, in order (run concurrently)."""
        calls = message.tool_calls if hasattr(message, "tool_calls") else message.get("tool_calls")
        return list(await asyncio.gather(*[self.run(c) for c in calls or []]))

    async def _invoke(self, name: str, arguments: str | dict) -> Any:
        fn = self.functions.get(name)
        if fn is None:
            raise _ToolError(f"no tool named {name!r} (tools: {', '.join(self.functions)})")
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
            raise _ToolError(f"arguments are not JSON ({e.msg})") from None
        if not isinstance(args, dict):
            raise _ToolError("arguments must be a JSON object")
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            raise _ToolError(f"{name}: {e}") from None
        if inspect.iscoroutinefunction(fn):
            work = fn(**args)
        else:
            work = asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(**args))
        try:
            return await asyncio.wait_for(work, timeout=self.timeout_s)
        except TimeoutError:
            raise _ToolError(f"{name} did not answer within {self.timeout_s:g} s") from None

    def _cut(self, out: Any) -> str:
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        if len(text) > self.max_chars:
            return text[:self.max_chars] + f"... [cut: {len(text):,} characters]"
        return text


def sandboxed_python(client, name: str = "python"):
    """A tool that runs the model's Python program in the reward sandbox (`client.run_code`):
    what it printed, or why it stopped. For a Toolbox of this episode: `Toolbox(sandboxed_python(client))`."""
    async def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
            code: the program; print what you need to see
        """
        ran = (await client.run_code(code)).details
        if ran.get("status") == "ok":
            return ran.get("stdout") or "(the program printed nothing)"
        tail = (ran.get("stderr") or ran.get("reason") or "").strip().splitlines()[-1:]
        raise _ToolError(f"{ran.get('status', 'failed')}" + (f": {tail[0]}" if tail else ""))

    python.__name__ = python.__qualname__ = name
    return python


class _ToolError(Exception):
    """A failure whose message is already the model's to read."""
