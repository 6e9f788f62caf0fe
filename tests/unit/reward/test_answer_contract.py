"""The answer contract of training rewards, from the attacks (issue 22): an answer that names
several candidates for a one-value reference is wrong, the legitimate multi-value forms stay
right, and an answer whose grading would cost seconds is wrong at once."""
from __future__ import annotations

import pytest

from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math

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


# Issue 32: every spelling of a hedge is refused, read from the answer's structure, not from a
# list of separator words.
@pytest.mark.parametrize("gold, response", [
    ("12", r"\boxed{12 \vee 13}"),
    ("12", r"\boxed{12 ∨ 13}"),
    ("12", r"\boxed{12 \mid 13}"),
    ("12", r"\boxed{12 | 13}"),
    ("12", r"\boxed{12 \\ 13}"),                    # a LaTeX line break
    ("12", r"\boxed{12 \text{ OR } 13}"),
    ("12", r"\boxed{12 OR 13}"),
    ("12", "The answer is 12 OR 13."),
    ("12", "The answer is 12 and 13."),
    ("12", r"\boxed{12 \text{ and } 13}"),
    ("12", r"\boxed{12 \boxed{13}}"),               # a box inside a box
    ("12", r"\boxed{\boxed{12} 13}"),
    ("12", r"\boxed{12}, or possibly 13"),          # a hedge after the box
    ("12", r"$\boxed{12}$ (or maybe 13)."),
    ("12", r"\boxed{\begin{cases} 12 & x > 0 \\ 13 & x \le 0 \end{cases}}"),
    ("12", r"\boxed{12 = 13}"),                     # a false equation names both
    ("12", "The answer is $12 = 13$."),
    ("12", r"\boxed{12\;13}"),                      # spacing is not an operator either
    ("12", r"\boxed{12 \heartsuit 13}"),            # nor any symbol nobody listed
    ("12", r"\boxed{12\text{ (or 13)}}"),
])
def test_every_spelling_of_a_hedge_is_refused(gold, response):
    v = grade_math(response, gold, CFG)
    assert not v.correct and v.details["reason"].startswith("hedged"), v.details
    assert v.details.get("hedged") is True


@pytest.mark.parametrize("gold, response", [
    ("5", r"\boxed{5\,\text{cm}}"),                 # LaTeX's spaces are not list separators
    (r"3\sqrt{2}", r"\boxed{3\,\sqrt{2}}"),
    ("1000", r"\boxed{1\,000}"),
    ("1000", r"\boxed{1\;000}"),
    ("5", r"\boxed{5\ \text{cm}}"),
    ("5", r"\boxed{5\!\text{ cm}}"),
    ("5", r"\boxed{5~\text{cm}}"),
    ("5", r"\boxed{5 \quad \text{cm}}"),
    ("12", "The answer is 12, as required."),      # a trailing clause is not a second answer
    ("12", "The answer is 12, which we check by substitution."),
    ("12", r"\boxed{12}, as required."),
    ("16386.17", r"worth $\boxed{\$16386.17}$ after 5 years."),
    ("12", r"\boxed{\boxed{12}}"),
    ("12", r"\boxed{x = 12}"),
    ("3", r"\boxed{\frac{6}{2} = 3}"),
    ("34", "Final Answer: The largest $n$ is 34."),
    ("2, 3", r"\boxed{x = 2 \text{ or } x = 3}"),     # the reference has two values
    (r"\{2, 3\}", r"\boxed{\{2, 3\}}"),
    ("(1, 3)", r"\boxed{(1,3)}"),
    (r"(-\infty, 0) \cup (1, \infty)", r"\boxed{(-\infty, 0) \cup (1, \infty)}"),
    (r"\pm 2", r"\boxed{x = \pm 2}"),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}"),
])
def test_right_answers_in_any_spacing_or_sentence_score_right(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details


@pytest.mark.parametrize("gold, response, hedged", [
    ("12", r"\boxed{12}. Or 13.", True),                        # the line after the box is read
    ("12", r"\boxed{12} \text{ or } 13", True),
    ("12", r"\boxed{12} \text{after} 5 years", False),          # a clause, not an alternative
    ("12", "\\boxed{12}.\n\n1. First we add.", False),           # a new line is not an alternative
    ("12", r"$\boxed{12}$. I hope it is correct, 13 was close.", False),
])
def test_what_follows_the_box_on_its_line(gold, response, hedged):
    v = grade_math(response, gold, CFG)
    assert v.correct is not hedged and v.details["reason"].startswith("hedged") is hedged, v.details


@pytest.mark.parametrize("gold, response, hedged", [
    ("12", "The answer is 12. Or 13.", True),                # the line after the answer sentence
    ("12", "The answer is 12. Maybe 13.", True),
    ("12", "The answer is 12. I hope it is correct, 13 was close.", False),
    ("14", "The answer is 14.\n\nLet me know if you have questions about steps 1 to 3.", False),
])
def test_what_follows_the_answer_sentence_on_its_line(gold, response, hedged):
    v = grade_math(response, gold, CFG)
    assert v.correct is not hedged and v.details["reason"].startswith("hedged") is hedged, v.details
