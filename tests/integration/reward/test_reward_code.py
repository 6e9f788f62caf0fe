"""Code verdicts through the real sandbox: correct, wrong, crashing and timing-out programs in
both test formats, early exits that must not pass, and the rlimits-only fallback's labels."""

from __future__ import annotations

import shutil

import pytest

from tandem.reward.code_grader import grade_code
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import Sandbox

CFG = RewardConfig(code_test_timeout_s=1.0, code_total_timeout_s=6.0)
RLIMITS = RewardConfig(code_test_timeout_s=1.0, code_total_timeout_s=6.0, sandbox="rlimits", allow_unisolated=True)
STDIO = {"inputs": ["1 2\n", "10 20\n", "-1 1\n"], "outputs": ["3\n", "30", "0\n"]}
CALL = {"fn_name": "add", "inputs": [[1, 2], [10, 20], [-1, 1]], "outputs": [3, 30, 0]}
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or Sandbox(CFG).isolation != "bwrap",
                                 reason="bubblewrap not installed or not permitted here")


def fenced(src: str) -> str:
    return f"Here is my solution.\n```python\n{src}\n```\n"


STDIO_PROGRAMS = {
    "correct": ("a, b = map(int, input().split())\nprint(a + b)", 3),
    "correct_sys_stdin": ("import sys\nprint(sum(map(int, sys.stdin.read().split())))", 3),
    "correct_exit0": ("import sys\nprint(sum(map(int, open(0).read().split())))\nsys.exit(0)", 3),
    "wrong": ("a, b = map(int, input().split())\nprint(a - b)", 0),
    "crash": ("raise RuntimeError('boom')", 0),
    "exit1": ("import sys\nprint(3)\nsys.exit(1)", 0),
    "timeout": ("while True:\n    pass", 0),
}
CALL_PROGRAMS = {
    "correct": ("def add(a, b):\n    return a + b", 3),
    "correct_class": ("class Solution:\n    def add(self, a, b):\n        return a + b", 3),
    "wrong": ("def add(a, b):\n    return a - b", 0),
    "crash": ("def add(a, b):\n    raise ValueError('boom')", 0),
    "partial_crash": ("def add(a, b):\n    if a > 5:\n        raise ValueError\n    return a + b", 2),
    "timeout": ("def add(a, b):\n    while True:\n        pass", 0),
    "missing_fn": ("def other(a, b):\n    return a + b", 0),
    "sys_exit_before_checks": ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", 0),
    "os_exit_before_checks": ("import os\nos._exit(0)\ndef add(a, b):\n    return a + b", 0),
    "exit_inside_call": ("def add(a, b):\n    import os\n    os._exit(0)", 0),
}


@needs_bwrap
@pytest.mark.parametrize("name", list(STDIO_PROGRAMS))
def test_stdio_programs(name):
    src, passed = STDIO_PROGRAMS[name]
    v = grade_code(fenced(src), STDIO, CFG)
    assert v.details["isolation"] == "bwrap"
    assert v.details["passed"] == passed, v.details
    assert v.correct == (passed == 3) and v.reward == (5.0 if passed == 3 else -5.0)
    if name == "timeout":
        assert v.details["tests"][0]["status"] == "timeout"


@needs_bwrap
@pytest.mark.parametrize("name", list(CALL_PROGRAMS))
def test_function_call_programs(name):
    src, passed = CALL_PROGRAMS[name]
    v = grade_code(fenced(src), CALL, CFG)
    assert v.details["passed"] == passed, v.details
    assert v.correct == (passed == 3)
    assert len(v.details["tests"]) == 3 or name == "missing_fn" and v.details["tests"]


def test_partial_credit_and_no_program():
    cfg = RewardConfig(code_partial_credit=True, code_test_timeout_s=1.0, code_total_timeout_s=6.0)
    v = grade_code(fenced(CALL_PROGRAMS["partial_crash"][0]), CALL, cfg)
    assert not v.correct and v.reward == pytest.approx(-5.0 + 10.0 * 2 / 3)
    v = grade_code("<think>```python\ndef add(a, b): return a + b\n```", CALL, cfg)
    assert not v.correct and v.details["reason"].startswith("no program")


def test_bare_code_answer_like_the_synthetic_task():
    tests = {"fn_name": "f", "inputs": [[1], [2], [4]], "outputs": [3, 5, 9]}
    assert grade_code("def f(x): return 2*x+1", tests, CFG).correct


@pytest.mark.parametrize("name", ["correct", "wrong", "timeout"])
def test_rlimits_only_fallback_grades_and_says_so(name):
    src, passed = STDIO_PROGRAMS[name]
    v = grade_code(fenced(src), STDIO, RLIMITS)
    assert v.details["isolation"] == "rlimits-only"
    assert v.details["passed"] == passed
    src, passed = CALL_PROGRAMS["os_exit_before_checks"]
    v = grade_code(fenced(src), CALL, RLIMITS)
    assert not v.correct and v.details["isolation"] == "rlimits-only"


@needs_bwrap
def test_many_tests_under_default_limits_all_pass():
    # Default limits (5 s per test, 30 s total): the per-child CPU limit must stay under the
    # harness's own, or every child dies before reporting (a correct program would fail).
    tests = {"fn_name": "f", "inputs": [[i] for i in range(20)], "outputs": [2 * i + 1 for i in range(20)]}
    v = grade_code(fenced("def f(x):\n    return 2 * x + 1"), tests, RewardConfig())
    assert v.correct and v.details["passed"] == 20, v.details["reason"]
    stdio = {"inputs": [f"{i}\n" for i in range(20)], "outputs": [str(2 * i + 1) for i in range(20)]}
    v = grade_code(fenced("print(2 * int(input()) + 1)"), stdio, RewardConfig())
    assert v.correct and v.details["passed"] == 20, v.details["reason"]


def test_program_that_fails_to_load_says_why():
    v = grade_code(fenced("def add(a, b) return"), CALL, CFG)
    assert not v.correct and "SyntaxError" in v.details["reason"]


def test_file_size_limit_applies_to_the_program_not_to_large_inputs():
    cfg = RewardConfig(code_test_timeout_s=5.0, code_total_timeout_s=10.0, code_max_file_mb=1)
    big = "1 " * (3 << 20)  # 6 MiB of stdin, over the program's 1 MiB file limit
    v = grade_code(fenced("import sys\nprint(len(sys.stdin.read().split()))"),
                   {"inputs": [big], "outputs": [str(3 << 20)]}, cfg)
    assert v.correct, v.details
    writer = "open('f.bin', 'wb').write(b'x' * (2 << 20))\nprint('ok')"
    v = grade_code(fenced(writer), {"inputs": [""], "outputs": ["ok"]}, cfg)
    assert not v.correct
    assert v.details["tests"][0]["status"] in ("file size limit", "runtime error (exit 1)"), v.details


def test_invalid_tests_are_a_verdict_not_an_exception():
    v = grade_code(fenced("print(1)"), {"inputs": ["1"], "outputs": []}, CFG)
    assert not v.correct and "invalid tests" in v.details["reason"]
