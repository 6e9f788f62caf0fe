"""Reward functions for the tests of `reward.function` in a real reward service: one function
whose behaviour the response picks, so one service covers every case (the workers import it
through PYTHONPATH, as a user's module would be found)."""
from __future__ import annotations

import math
import os
import signal
import time


def dispatch(prompt: str, response: str, row: dict):
    calls = os.environ.get("TANDEM_TEST_REWARD_CALLS")
    if calls:   # one line per call: the verdict cache's repeats never reach the function
        with open(calls, "a") as f:
            f.write(response + "\n")
    word = response.split(" ", 1)[0]
    if word == "nan":            # the policy found the input that breaks the function
        return math.nan
    if word == "huge":
        return {"reward": 1e308, "correct": True}
    if word == "bool":
        return True
    if word == "raise":
        raise KeyError("no such field")
    if word == "sleep":          # Python code past the limit: the worker's timer stops it
        time.sleep(60)
    if word == "block":          # deaf to the timer (as C code can be): the pool's hard limit kills it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    if word == "exit":
        os._exit(3)
    if word == "print":
        print("a function that prints does not corrupt the worker's replies")
    return {"reward": 2.5, "reason": "mirrored", "prompt": prompt, "row": row}


async def async_dispatch(prompt: str, response: str, row: dict):
    import asyncio
    await asyncio.sleep(0.01)
    return dispatch(prompt, response, row)
