"""Tests judged by a benchmark's own rules, through the real sandbox.

LiveCodeBench (`convention: livecodebench`; rules read from its official grader,
lcb_runner/evaluation/testing_util.py): every program gets the standard modules it lists and
`from typing import *` without importing them; a LeetCode program's `Solution().<fn_name>` is
called; a returned tuple counts as a list and values compare with `==`; stdout must have as many
lines as expected, and a line that differs as text must hold the same numbers as exact
decimals (no tolerance). Each case is a program a model writes for that benchmark, with the
verdict its official grader gives."""
from __future__ import annotations

import shutil

import pytest

from tandem.reward.code_grader import grade_code
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import Sandbox

CFG = RewardConfig(code_test_timeout_s=2.0, code_total_timeout_s=10.0)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or Sandbox(CFG).isolation != "bwrap",
                                reason="bubblewrap not installed or not permitted here")
LCB = "livecodebench"
TWO_SUM = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
           "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
           "                return ANSWER\n            seen[x] = i\n")
TWO_SUM_TESTS = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]}
ROTATE = "q = deque(map(int, input().split()))\nq.rotate(1)\nprint(*q)"
ROTATE_TESTS = {"inputs": ["1 2 3\n", "4 5\n"], "outputs": ["3 1 2\n", "5 4\n"]}

CASES = {
    # name: (program, tests, passes under livecodebench, passes under tandem)
    "implicit_deque": (ROTATE, ROTATE_TESTS, True, False),
    "implicit_typing_in_solution": (TWO_SUM.replace("ANSWER", "[seen[target - x], i]"), TWO_SUM_TESTS, True, False),
    "tuple_for_list": ("from typing import List\n" + TWO_SUM.replace("ANSWER", "(seen[target - x], i)"),
                       TWO_SUM_TESTS, True, True),
    "recursion_depth_5000": ("def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\nprint(depth(5000))",
                             {"inputs": [""], "outputs": ["5000"]}, True, False),
    "trailing_zeros_same_decimal": ("print('0.50')", {"inputs": [""], "outputs": ["0.5\n"]}, True, True),
    "same_tokens_other_lines": ("print(1, 2)", {"inputs": [""], "outputs": ["1\n2\n"]}, False, True),
    "float_off_in_the_7th_digit": ("print(0.3333333)", {"inputs": [""], "outputs": ["0.33333333"]}, False, True),
    "integer_off_by_one": ("print(123456790)", {"inputs": [""], "outputs": ["123456789"]}, False, False),
    # `==` as the official grader has it: True == 1 (Tandem's own rule keeps bool apart)
    "bool_for_int": ("def f(x):\n    return True", {"fn_name": "f", "inputs": [[1]], "outputs": [1]}, True, False),
    "lines_stripped": ("print('  3 1 2  ')", {"inputs": [""], "outputs": ["3 1 2"]}, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_convention_gives_its_own_graders_verdict(name):
    program, tests, lcb, tandem = CASES[name]
    response = f"```python\n{program}\n```"
    got_lcb = grade_code(response, {**tests, "convention": LCB}, CFG)
    got_tandem = grade_code(response, tests, CFG)
    assert (got_lcb.correct, got_tandem.correct) == (lcb, tandem), (got_lcb.details, got_tandem.details)


def test_a_top_level_function_is_not_called_when_a_solution_class_exists():
    """LiveCodeBench calls Solution().<fn_name> whenever the program has `class Solution`."""
    program = ("def twoSum(nums, target):\n    return [0, 1]\n"
               "class Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]\n")
    tests = {**TWO_SUM_TESTS, "inputs": TWO_SUM_TESTS["inputs"][:1], "outputs": [[0, 1]]}
    assert not grade_code(f"```python\n{program}\n```", {**tests, "convention": LCB}, CFG).correct
    assert grade_code(f"```python\n{program}\n```", tests, CFG).correct


def test_the_preludes_stream_names_are_the_tests_own():
    """Where Tandem differs on purpose: `from sys import *` gives a program `stdin` and `stdout`;
    here they are the test's own streams (in the official grader they are the grader's, which a
    program reading its input through them would not see)."""
    program = "line = stdin.readline().strip()\nstdout.write(line[::-1] + '\\n')"
    tests = {"inputs": ["abc\n", "xy\n"], "outputs": ["cba", "yx"], "convention": LCB}
    verdict = grade_code(f"```python\n{program}\n```", tests, CFG)
    assert verdict.correct, verdict.details
