"""Tools that misbehave cost their turn, never the worker (rollout/agent_tools.py); and the
shipped calculator cannot be made to run away."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tandem.rollout.agent_tools import Toolbox, ToolFailed


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("disk on fire")


def sleepy(x: str) -> str:
    """Never answers in time.

    Args:
        x: anything
    """
    time.sleep(2)
    return "late"


async def async_sleepy(x: str) -> str:
    """Never answers in time, asynchronously.

    Args:
        x: anything
    """
    await asyncio.sleep(3600)


def flood(x: str) -> str:
    """Returns megabytes.

    Args:
        x: anything
    """
    return "y" * 5_000_000


def call(name, args):
    return {"id": "call_1", "function": {"name": name, "arguments": json.dumps(args)}}


def test_schemas_come_from_the_functions():
    [schema] = Toolbox(add).schemas
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}


@pytest.mark.parametrize("tool, name, args, expected", [
    (add, "add", {"a": 2, "b": 3}, "5"),
    (broken, "broken", {"x": "1"}, "error: RuntimeError: disk on fire"),
    (sleepy, "sleepy", {"x": "1"}, "error: sleepy did not answer within 0.2 s"),
    (async_sleepy, "async_sleepy", {"x": "1"}, "error: async_sleepy did not answer within 0.2 s"),
    (add, "nope", {}, "error: no tool named 'nope' (tools: add)"),
    (add, "add", {"a": 1}, "error: add: missing a required argument: 'b'"),
])
def test_a_misbehaving_tool_becomes_an_error_the_model_reads(tool, name, args, expected):
    box = Toolbox(tool, timeout_s=0.2)
    t0 = time.monotonic()
    message = asyncio.run(box.run(call(name, args)))
    assert message == {"role": "tool", "tool_call_id": "call_1", "name": name, "content": expected}
    assert time.monotonic() - t0 < 1.5   # a hanging tool costs its timeout, not its hang


def test_arguments_that_are_not_json():
    box = Toolbox(add)
    out = asyncio.run(box.call("add", "{a: 1"))
    assert out.startswith("error: arguments are not JSON")


def test_megabytes_are_cut_and_say_so():
    out = asyncio.run(Toolbox(flood, max_chars=100).call("flood", {"x": ""}))
    assert out == "y" * 100 + "... [cut: 5,000,000 characters]"


def test_on_error_episode_ends_the_episode():
    with pytest.raises(ToolFailed, match="tool 'broken': error: RuntimeError: disk on fire"):
        asyncio.run(Toolbox(broken, on_error="episode").call("broken", {"x": ""}))


def test_run_all_answers_every_call_in_order():
    message = {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 1, "b": 2}),
                                                                   call("add", {"a": 3, "b": 4})]}
    out = asyncio.run(Toolbox(add).run_all(message))
    assert [m["content"] for m in out] == ["3", "7"]


@pytest.mark.parametrize("expression, expected", [
    ("13*15-7-1-5", "182"), ("2*(3+4)", "14"), ("-3+10", "7"), ("7/2", "3.5"), ("8/2", "4"),
])
def test_calculator(expression, expected):
    from tandem.rollout.agents.calculator import calc
    assert calc(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "only numbers and"),
    ("9**9**9", "only numbers and"),
    ("1/0", "division by zero"),
    ("9" * 40 + "*" + "9" * 40, "too large"),
    ("(" * 200 + "1" + ")" * 200, "too long"),
])
def test_calculator_refuses_what_could_run_away(expression, message):
    from tandem.rollout.agents.calculator import calc
    with pytest.raises(ValueError, match=message):
        calc(expression)


def test_the_sandboxed_python_tool_reports_output_and_failures():
    """The reward service is a stand-in here (its sandbox runs are tested in
    tests/integration/reward/test_reward_function_service.py): what the tool makes of its answers."""
    from tandem.rollout.agent_tools import sandboxed_python
    from tandem.services.protocol import Verdict

    class Client:
        async def run_code(self, program, stdin=""):
            if "loop" in program:
                return Verdict(0.0, False, {"status": "cpu time limit", "stdout": "", "stderr": ""})
            if "raise" in program:
                return Verdict(0.0, False, {"status": "runtime error (exit 1)", "stdout": "",
                                            "stderr": "Traceback ...\nValueError: no"})
            return Verdict(0.0, True, {"status": "ok", "stdout": "42\n"})

    box = Toolbox(sandboxed_python(Client()))
    assert box.schemas[0]["function"]["name"] == "python"
    assert asyncio.run(box.call("python", {"code": "print(42)"})) == "42\n"
    assert asyncio.run(box.call("python", {"code": "loop"})) == "error: cpu time limit"
    assert asyncio.run(box.call("python", {"code": "raise"})) == "error: runtime error (exit 1): ValueError: no"
