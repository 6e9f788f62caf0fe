"""A user's reward (`reward.function: package.module:fn`): loading it, calling it, and reading
what it returns as a verdict that cannot be forged.

Why it is strict: the policy being trained is the adversary. Whatever response makes the
function misbehave — raise, hang, return NaN, inf, a bool, a string, a value past the configured
range — must earn no more than a wrong answer, and must be counted, not pass silently. So every
such item gets `wrong_reward`, `correct: false`, `details.refused: true` and a reason naming
what happened; the pool counts them (`user_refused`). A value is never clamped into range:
clamping would hand a forged 1e308 the best reward there is.

The function runs in the grader workers (reward/worker.py), one item at a time on the main
thread: a synchronous function under the interval timer of reward/time_limit.py, an async one
under `asyncio.wait_for`; the pool kills a worker that holds an item past the hard limit
(C code that never returns to Python, an async function that blocks) and replaces it.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
from collections.abc import Callable
from typing import Any

from tandem.reward.config import FUNCTION_SPEC, RewardConfig
from tandem.reward.time_limit import TimeLimitExpired, time_limit
from tandem.services.protocol import Verdict, import_user_module

DETAILS_CHARS = 2000  # a function's details kept in a verdict, as JSON text
REASON_CHARS = 300


class RewardFunctionError(ValueError):
    """`reward.function` does not name a callable this Python can import."""


def load_reward_function(spec: str) -> Callable:
    """`package.module:function` → the function, imported as a grader worker imports it.

    The directory `tandem` runs in comes first on the path, as it does for the roles it starts
    (they run `python -m ...` there), so `examples.custom_reward.reward:score` imports from the
    checkout and a project's own `reward.py` is `reward:score`."""
    if not FUNCTION_SPEC.fullmatch(spec or ""):
        raise RewardFunctionError(f"must look like 'package.module:function', got {spec!r}")
    module_name, _, fn_name = spec.partition(":")
    try:
        module = import_user_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardFunctionError(f"{spec!r}: no module named {e.name!r} (is it installed, on PYTHONPATH, "
                                  f"or under the directory you run tandem in?)") from None
    except Exception as e:  # the module itself fails: a SyntaxError, its own error at import
        raise RewardFunctionError(f"{spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, fn_name):
        raise RewardFunctionError(f"{spec!r}: module {module_name!r} has no attribute {fn_name!r}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise RewardFunctionError(f"{spec!r}: {module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"))


def _is_number(x: Any) -> bool:
    # A bool (numpy's too) is not a reward: `return answer == ref` meant 1/0 on some scale nobody
    # wrote down; {"correct": ...} says it.
    return isinstance(x, numbers.Real) and not _is_bool(x)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain(x: Any) -> Any:
    """A value JSON cannot hold as itself: numpy's numbers as numbers, anything else as text."""
    if isinstance(x, numbers.Integral) and not _is_bool(x):
        return int(x)
    if isinstance(x, numbers.Real) and not _is_bool(x):
        return float(x)
    return bool(x) if _is_bool(x) else repr(x)


def _plain_details(extra: dict) -> dict:
    """The function's details as plain JSON values (numpy numbers, sets, objects as text), at most
    DETAILS_CHARS of them: they travel in msgpack and end in trajectory dumps and logs."""
    try:
        text = json.dumps(extra, default=_plain, allow_nan=True)
    except (TypeError, ValueError) as e:   # keys that are not strings, a cycle
        return {"unreadable": f"{type(e).__name__}: {e}"[:REASON_CHARS]}
    if len(text) > DETAILS_CHARS:
        return {"truncated": text[:DETAILS_CHARS]}
    return json.loads(text)


def refused(cfg: RewardConfig, base: dict, why: str, *, error: bool = False, limit: bool = False) -> Verdict:
    """The verdict of an item the user's reward could not score: wrong_reward, with the reason.

    `error` marks trouble that may pass (a timeout, an unreachable endpoint): the verdict cache
    forgets such a verdict, so the next identical item is scored again (reward/verdict_cache.py).
    `limit` counts it among the limits hit per training step, as a math timeout is."""
    details = {**base, "reason": f"refused: {why}"[:REASON_CHARS], "refused": True}
    if error:
        details["error"] = why[:REASON_CHARS]
    if limit:
        details["limit"] = True
    return Verdict(cfg.wrong_reward, False, details)


def verdict_from(value: Any, cfg: RewardConfig, base: dict, who: str) -> Verdict:
    """What the function (or endpoint) returned, as a verdict, or a refusal naming why.

    Accepted: a number; a map with `reward` (a number) and/or `correct` (a bool), the rest of
    it kept as `details.user`; a Verdict. A reward must be finite and within [wrong_reward,
    correct_reward]. Without `reward`, `correct` picks correct_reward or wrong_reward; without
    `correct`, a reward above the middle of that range counts as correct."""
    reward, correct, extra = value, None, {}
    if isinstance(value, Verdict):
        reward, correct, extra = value.reward, value.correct, dict(value.details or {})
    elif isinstance(value, dict):
        extra = {k: v for k, v in value.items() if k not in ("reward", "correct")}
        reward, correct = value.get("reward"), value.get("correct")
        if correct is not None and not isinstance(correct, bool):
            return refused(cfg, base, f"{who} returned 'correct': {_shown(correct)}; it must be true or false")
        if reward is None and correct is None:
            return refused(cfg, base, f"{who} returned a map with neither 'reward' nor 'correct' "
                                      f"(keys: {sorted(map(str, value))[:10]})")
        if reward is None:
            reward = cfg.correct_reward if correct else cfg.wrong_reward
    elif _is_bool(value):
        return refused(cfg, base, f"{who} returned {value!r}, a bool; return a number, or "
                                  f"{{'correct': {value!r}}} for correct_reward / wrong_reward")
    if not _is_number(reward):
        return refused(cfg, base, f"{who} returned {_shown(reward)} ({type(reward).__name__}), not a number")
    reward = float(reward)
    if not math.isfinite(reward):
        return refused(cfg, base, f"{who} returned {reward}, not a finite number")
    lo, hi = cfg.wrong_reward, cfg.correct_reward
    if not lo <= reward <= hi:
        return refused(cfg, base, f"{who} returned {reward:g}, outside [wrong_reward, correct_reward] = "
                                  f"[{lo:g}, {hi:g}] (set those to the range your function returns)")
    if correct is None:
        correct = reward > (lo + hi) / 2
    reason = extra.get("reason")
    details = {**base, "reason": str(reason)[:REASON_CHARS] if reason is not None else f"scored by {who}"}
    if extra:
        details["user"] = _plain_details(extra)
    return Verdict(reward, bool(correct), details)


class FunctionGrader:
    """Calls the user's function for one item at a time, within `cfg.function_timeout_s`."""

    def __init__(self, cfg: RewardConfig, fn: Callable | None = None):
        self.cfg = cfg
        self.fn = fn or load_reward_function(cfg.function)
        # (An object whose __call__ is async returns a coroutine from the plain call: awaited below.)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.base = {"grader": "function", "source": cfg.function or getattr(self.fn, "__name__", "?")}

    def _run(self, awaitable, timeout: float):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(asyncio.wait_for(awaitable, timeout))

    def grade(self, task: str, prompt: str, response: str, row: dict) -> Verdict:
        base = {"task": task, **self.base}
        timeout = self.cfg.function_timeout_s
        who = "reward.function"
        try:
            if self.is_async:
                value = self._run(self.fn(prompt, response, row), timeout)
            else:
                with time_limit(timeout):
                    value = self.fn(prompt, response, row)
                if inspect.isawaitable(value):      # a plain function that returned a coroutine
                    value = self._run(value, timeout)
        except TimeLimitExpired:
            return refused(self.cfg, base, f"timeout: {who} took over {timeout:g}s", error=True, limit=True)
        except TimeoutError as e:   # asyncio.wait_for's, or one of the function's own (a socket's)
            return refused(self.cfg, base, f"timeout: {who} took over {timeout:g}s or timed out itself "
                                           f"({type(e).__name__}: {e})", error=True, limit=True)
        except BaseException as e:  # noqa: BLE001  (SystemExit too: the worker must go on)
            return refused(self.cfg, base, f"{who} raised {type(e).__name__}: {e}")
        return verdict_from(value, self.cfg, base, who)
