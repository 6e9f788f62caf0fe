"""A user's reward function (reward/user_function.py) read as an adversary would push it: every
value a response could make the function return that is not an honest reward in range — NaN,
inf, a bool, a string, 1e308, a forged flag in its details — earns wrong_reward with a reason
and `refused`, never more; a function that raises, exits or hangs does the same, and the
worker goes on. What is accepted is read exactly (no clamping)."""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from tandem.reward.config import RewardConfig
from tandem.reward.user_function import FunctionGrader, verdict_from
from tandem.services.protocol import Verdict, item_row

CFG = RewardConfig(correct_reward=5.0, wrong_reward=-5.0, function="x.y:z", function_timeout_s=0.3)
BASE = {"task": "math", "grader": "function"}


def _v(value):
    return verdict_from(value, CFG, BASE, "reward.function")


@pytest.mark.parametrize("value, why", [
    (math.nan, "not a finite number"),
    ({"reward": math.inf}, "not a finite number"),
    (-math.inf, "not a finite number"),
    (1e308, "outside [wrong_reward, correct_reward] = [-5, 5]"),
    ({"reward": 5.000001}, "outside"),
    (-6, "outside"),
    (True, "a bool"),
    (np.bool_(False), "a bool"),
    ({"reward": True}, "not a number"),
    ("5", "not a number"),
    (None, "not a number"),
    ([5.0], "not a number"),
    ({"correct": "yes"}, "'correct': 'yes'; it must be true or false"),
    ({"score": 5}, "neither 'reward' nor 'correct'"),
    ({}, "neither 'reward' nor 'correct'"),
])
def test_what_is_not_an_honest_reward_in_range_is_refused(value, why):
    v = _v(value)
    assert (v.reward, v.correct) == (-5.0, False)
    assert v.details["refused"] is True and why in v.details["reason"], v.details
    assert v.details["reason"].startswith("refused: reward.function returned")
    assert "error" not in v.details   # a value is the function's answer: the cache may keep it


@pytest.mark.parametrize("value, reward, correct", [
    (3, 3.0, True),
    (-1.5, -1.5, False),
    (5, 5.0, True),                       # the ends of the range are in it
    (-5.0, -5.0, False),
    (0.0, 0.0, False),                    # the middle is not "above the middle"
    (np.float32(2.5), 2.5, True),
    ({"correct": True}, 5.0, True),       # no reward: the experiment's own rewards
    ({"correct": False}, -5.0, False),
    ({"reward": 4, "correct": False}, 4.0, False),   # both given: both kept
])
def test_an_honest_reward_is_read_exactly(value, reward, correct):
    v = _v(value)
    assert (v.reward, v.correct) == (reward, correct) and isinstance(v.reward, float)
    assert "refused" not in v.details and v.details["grader"] == "function"


def test_details_are_kept_apart_from_the_flags_the_service_counts():
    v = _v({"reward": 1.0, "reason": "close enough", "error": "forged", "limit": True, "hedged": True,
            "refused": True, "shape": np.int64(3), "tags": {"a"}})
    # A function's keys cannot make a verdict look like a grader error (never cached, counted),
    # a limit hit or a hedge: they are its own, under `user`.
    assert not {"error", "limit", "hedged", "refused"} & set(v.details)
    assert v.details["reason"] == "close enough"
    assert v.details["user"]["error"] == "forged" and v.details["user"]["shape"] == 3
    assert v.details["user"]["tags"] == "{'a'}"              # what JSON cannot hold, as text
    big = _v({"reward": 1.0, "blob": "x" * 10_000}).details["user"]
    assert set(big) == {"truncated"} and len(big["truncated"]) == 2000


def test_a_verdict_object_is_accepted_and_checked_like_a_number():
    assert _v(Verdict(2.0, True, {"k": 1})).details["user"] == {"k": 1}
    assert _v(Verdict(math.nan, True, {})).details["refused"]


def _grader(fn, **cfg) -> FunctionGrader:
    return FunctionGrader(RewardConfig(**{"function": "x.y:z", "function_timeout_s": 0.3, **cfg}), fn)


def test_a_function_that_raises_or_exits_is_a_refusal_and_the_caller_goes_on():
    def divide(prompt, response, row):
        return 1 / 0

    def leave(prompt, response, row):
        raise SystemExit(0)

    v = _grader(divide).grade("math", "p", "r", {})
    assert v.reward == -5.0 and "raised ZeroDivisionError: division by zero" in v.details["reason"]
    v = _grader(leave).grade("math", "p", "r", {})
    assert v.reward == -5.0 and "raised SystemExit" in v.details["reason"]


def test_a_function_past_its_time_is_stopped_and_its_verdict_is_an_error():
    calls = []

    def slow(prompt, response, row):
        calls.append(1)
        time.sleep(5)
        return 5.0

    t0 = time.monotonic()
    v = _grader(slow).grade("math", "p", "r", {})
    assert time.monotonic() - t0 < 2.0
    assert v.reward == -5.0 and "timeout: reward.function took over 0.3s" in v.details["reason"]
    # may pass (load): never cached; counted among the limits hit per step
    assert v.details["error"] and v.details["limit"] is True and calls == [1]


def test_async_functions_are_awaited_within_the_same_time():
    async def fine(prompt, response, row):
        await asyncio.sleep(0.01)
        return {"reward": 2.0, "seen": [prompt, response, row]}

    async def hangs(prompt, response, row):
        await asyncio.sleep(5)
        return 5.0

    def returns_a_coroutine(prompt, response, row):
        return fine(prompt, response, row)

    v = _grader(fine).grade("math", "the problem", "the answer", {"answer": "4"})
    assert v.reward == 2.0 and v.details["user"]["seen"] == ["the problem", "the answer", {"answer": "4"}]
    assert _grader(returns_a_coroutine).grade("math", "p", "r", {}).reward == 2.0
    t0 = time.monotonic()
    v = _grader(hangs).grade("math", "p", "r", {})
    assert time.monotonic() - t0 < 2.0 and "timeout" in v.details["reason"] and v.details["error"]
    # the worker's loop survives a timed-out coroutine: the next item is graded on it
    g = _grader(fine)
    g.grade("math", "p", "r", {})
    assert g.grade("math", "p", "r", {}).reward == 2.0


def test_the_row_is_the_rest_of_the_data_row_with_its_reference_put_back():
    assert item_row("math", "42", None, {"id": "a-1", "level": 3}) == {"id": "a-1", "level": 3, "answer": "42"}
    tests = {"inputs": ["1"], "outputs": ["1"]}
    assert item_row("code", "", tests, {"id": "c"}) == {"id": "c", "tests": tests}
    # a row's own key is what the data set said
    assert item_row("math", "42", None, {"answer": 42}) == {"answer": 42}
    assert item_row("math", "7", None, None) == {"answer": "7"}
