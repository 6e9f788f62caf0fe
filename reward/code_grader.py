"""Code verdicts: the response's program run against the task's tests in the sandbox.

Tests follow the APPS/TACO `input_output` convention: `{"inputs": [...], "outputs": [...],
"fn_name": optional}`. Without `fn_name` each input is a program's stdin and each output its
expected stdout (compared token by token, whitespace-insensitive, floats to 1e-6); with it each
input is the list of positional arguments of a top-level function (or a `Solution` method) of
that name and each output the expected return value.
"""
from __future__ import annotations

import re

from tandem.reward.config import RewardConfig
from tandem.reward.extract import extract_program
from tandem.reward.sandbox import UNISOLATED, Sandbox
from tandem.services.protocol import Verdict, code_tests_problem

_SANDBOXES: dict[str, Sandbox] = {}
MAX_SHOWN_TESTS = 20  # per-test records kept in a verdict (the counts cover all of them)
SHOWN = 500  # characters of the extracted program kept in a verdict
# Test statuses of a program stopped by a limit (time, CPU, memory, output, file size, processes).
_LIMIT = re.compile(r"time|limit|killed|MemoryError|memory", re.IGNORECASE)


def sandbox_for(cfg: RewardConfig) -> Sandbox:
    """One Sandbox per config per process (bubblewrap is probed once)."""
    key = repr(cfg)
    if key not in _SANDBOXES:
        _SANDBOXES[key] = Sandbox(cfg)
    return _SANDBOXES[key]


def _reward(cfg: RewardConfig, passed: int, total: int) -> float:
    if passed == total and total:
        return cfg.correct_reward
    if cfg.code_partial_credit and total:
        return cfg.wrong_reward + (cfg.correct_reward - cfg.wrong_reward) * passed / total
    return cfg.wrong_reward


def grade_code(response: str, tests: dict, cfg: RewardConfig | None = None) -> Verdict:
    """Grade one response; every failure of the program is a verdict, never an exception."""
    cfg = cfg or RewardConfig()
    sandbox = sandbox_for(cfg)
    base = {"task": "code", "isolation": sandbox.isolation}
    if sandbox.isolation != "bwrap" and not cfg.allow_unisolated:
        return Verdict(cfg.wrong_reward, False, {**base, "reason": UNISOLATED})
    problem = code_tests_problem(tests)
    if problem:
        return Verdict(cfg.wrong_reward, False, {**base, "reason": f"invalid tests: {problem}"})
    program, found = extract_program(response)
    if program is None:
        return Verdict(cfg.wrong_reward, False, {**base, "reason": f"no program: {found}", "extracted": None})
    result = sandbox.run(program, tests["inputs"], tests["outputs"], tests.get("fn_name"),
                         tests.get("convention", "tandem"))
    total = len(tests["inputs"])
    if result.error:
        return Verdict(cfg.wrong_reward, False, {**base, "reason": f"sandbox error: {result.error}", "limit": True,
                                                 "extracted": program[:SHOWN], "found": found, "passed": 0, "total": total,
                                                 "seconds": round(result.seconds, 3)})
    passed = sum(1 for t in result.tests if t.get("passed") is True)
    if len(result.tests) != total:  # the harness answers every test; anything else is a failure
        passed = 0
    ok = passed == total
    first_failure = next((t["status"] for t in result.tests if not t.get("passed")), None)
    limit = any(_LIMIT.search(str(t.get("status", ""))) for t in result.tests)
    reason = "all tests passed" if ok else f"{passed}/{total} tests passed; first failure: {first_failure}"
    return Verdict(_reward(cfg, passed, total), ok,
                   {**base, "reason": reason, "extracted": program[:SHOWN], "found": found, "passed": passed, "total": total,
                    **({"limit": True} if limit else {}),
                    "tests": result.tests[:MAX_SHOWN_TESTS], "seconds": round(result.seconds, 3)})
