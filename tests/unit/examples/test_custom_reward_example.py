"""The example reward function (examples/custom_reward/reward.py) does what its README says, and
its rewards stay within the range configs/math-tiny.yaml gives (else the service would refuse
them): the right final answer, the box bonus, the length penalty, thinking that never ends,
and a hostile response that costs one scan. The built-in grader wrapped as a user function
(builtin_math.py) gives the grader's verdicts."""
from __future__ import annotations

import time

import pytest

from examples.custom_reward.builtin_math import grade
from examples.custom_reward.reward import score
from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math
from tandem.reward.user_function import verdict_from

TINY = RewardConfig(correct_reward=1.0, wrong_reward=-1.0)   # configs/math-tiny.yaml's range


@pytest.mark.parametrize("response, answer, reward, correct", [
    (r"so the total is \boxed{1{,}000}.", "1000", 1.0, True),
    ("<think>7 * 6</think> The answer is 42.", "42", 0.8, True),
    (r"<think>maybe \boxed{42}</think> I give up", "42", -0.8, False),   # a box while thinking never counts
    ("<think>42 42 42", "42", -0.8, False),                               # thinking that never ends: no answer
    (r"\boxed{41}", "42", -0.6, False),                                   # boxed but wrong: the format bonus only
    (r"\boxed{0.5}", "1/2", -0.6, False),                                 # exact match: no symbolic equivalence
    ("x" * 2989 + r" \boxed{42}", "42", 0.9, True),                        # 3000 characters, 1000 over: half the penalty
    ("x" * 9000 + " 41", "42", -1.0, False),                              # the floor: wrong, unboxed, rambling
])
def test_rewards_and_their_range(response, answer, reward, correct):
    got = score("What is it?", response, {"answer": answer, "id": "t"})
    assert (got["reward"], got["correct"]) == (pytest.approx(reward), correct), got
    v = verdict_from(got, TINY, {}, "reward.function")
    assert "refused" not in v.details and v.reward == pytest.approx(reward)


def test_a_hostile_response_costs_one_scan():
    t0 = time.monotonic()
    got = score("q", r"\boxed{" * 200_000 + "41", {"answer": "42"})   # no box ever closes
    assert time.monotonic() - t0 < 2.0
    assert (got["reward"], got["boxed"], got["extracted"]) == (-1.0, False, "41")


@pytest.mark.parametrize("response, answer, question", [
    (r"\boxed{\frac{1}{2}}", "0.5", ""),
    (r"\boxed{12} or \boxed{13}", "12", ""),
    (r"\boxed{C}", "7", r"Pick one: \textbf{(A) }4\qquad\textbf{(B) }6\qquad\textbf{(C) }7"),
])
def test_the_wrapped_builtin_grader_gives_the_graders_verdict(response, answer, question):
    built_in = grade_math(response, answer, RewardConfig(), question=question)
    v = verdict_from(grade(question, response, {"answer": answer}), RewardConfig(), {}, "reward.function")
    assert (v.reward, v.correct) == (built_in.reward, built_in.correct)
    assert v.details["reason"] == built_in.details["reason"]
