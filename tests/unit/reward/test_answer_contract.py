"""The answer contract of training rewards, from the attacks (issue 22): an answer that names
several candidates for a one-value reference is wrong, the legitimate multi-value forms stay
right, and an answer whose grading would cost seconds is wrong at once."""
from __future__ import annotations

import pytest

from reward.config import RewardConfig
from reward.math_grader import grade_math

CFG = RewardConfig(math_timeout_s=5.0)


@pytest.mark.parametrize("gold, response", [
    ("12", "Working it out, I get either 12 or 13. The answer is 12 or 13."),
    ("12", r"The answer is \boxed{12 \text{ or } 13}."),
    ("12", r"It is \boxed{12} or \boxed{13}."),
    ("12", r"\boxed{12}, \boxed{13}"),
    ("12", r"\boxed{12, 13}"),
    ("12", r"\boxed{\{12, 13\}}"),
    ("3", r"\boxed{\pm 3}"),
    ("3", r"\boxed{3 \lor 4}"),
    ("1", r"\boxed{1, 2}"),
    ("2", r"\boxed{(1, 3)}"),                 # an interval around the answer
    ("12", "The answer is 12, 13."),
])
def test_hedged_answers_score_wrong(gold, response):
    v = grade_math(response, gold, CFG)
    assert not v.correct and v.reward == CFG.wrong_reward
    assert v.details["reason"].startswith("hedged"), v.details


@pytest.mark.parametrize("gold, response", [
    ("2, 3", r"\boxed{2, 3}"),                     # the reference has two roots
    (r"\pm 3", r"\boxed{\pm 3}"),
    ("[1,2)", r"\boxed{[1, 2)}"),
    ("[2,714)", r"\boxed{[2, 714)}"),                # not the number 2,714
    ("1000000", r"\boxed{1,000,000}"),             # thousands separators are one number
    ("12", r"First \boxed{13}; wait, that is wrong: \boxed{12}"),     # a retraction, then the answer
    ("3", r"First \boxed{2}, then finally \boxed{3}"),
    ("42", "So, the answer is 42."),               # a sentence's comma is not a list
    ("3.5", "The answer is 3.5."),
    ("42", "The final answer is 42. Hope this helps!"),
])
def test_legitimate_forms_still_score_right(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details


@pytest.mark.parametrize("response", [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{10^{10^{10}}}",
    r"\boxed{100000!}",
    r"\boxed{(x+1)^{100000}}",
    r"\boxed{" + "{" * 200 + "1" + "}" * 200 + "}",
    r"\boxed{" + "1+" * 100_000 + "1}",
])
def test_pathological_answers_are_refused_before_any_symbolic_work(response):
    """Refused by their shape, not by the timeout (benchmarks/reward.py measures the cost)."""
    v = grade_math(response, "1", CFG)
    assert not v.correct and v.details["reason"].startswith("too costly"), v.details
