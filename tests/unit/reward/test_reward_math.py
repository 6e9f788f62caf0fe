"""Math verdicts: equivalent forms, the last box, <think> blocks, fallbacks, timeouts."""
from __future__ import annotations

import threading

import pytest

from tandem.reward.config import RewardConfig
from tandem.reward.extract import answer_text, extract_program, last_boxed
from tandem.reward.math_grader import grade_math

CFG = RewardConfig(math_timeout_s=2.0)


@pytest.mark.parametrize("gold, response", [
    ("1/2", r"so \boxed{0.5}"),
    (r"\frac{1}{2}", r"\boxed{\dfrac{1}{2}}"),
    ("0.75", r"\boxed{\frac34}"),
    ("1000000", r"\boxed{1,000,000}"),
    ("50\\%", r"\boxed{50\%}"),
    ("0.5", r"\boxed{50\%}"),
    ("[1,2)", r"\boxed{[1, 2)}"),
    ("(-\\infty, 3]", r"\boxed{(-\infty,3]}"),
    ("5", r"\boxed{5\text{ cm}}"),
    ("30", r"\boxed{30^\circ}"),
    ("30^\\circ", r"\boxed{30}"),
    ("x+1", r"\boxed{1+x}"),
    ("\\sqrt{2}/2", r"\boxed{\frac{1}{\sqrt{2}}}"),
    ("\\boxed{7}", r"\boxed{7}"),
    ("3", "<think>Maybe \\boxed{4}? No.</think>The answer is \\boxed{3}."),
])
def test_equivalent_forms_are_correct(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details
    assert v.reward == CFG.correct_reward
    assert v.details["reason"] == "correct"


@pytest.mark.parametrize("gold, response", [
    ("3", r"\boxed{4}"),
    ("1/2", r"\boxed{0.51}"),
    ("[1,2)", r"\boxed{[1,2]}"),
])
def test_wrong_answers(gold, response):
    v = grade_math(response, gold, CFG)
    assert not v.correct and v.reward == CFG.wrong_reward
    assert v.details["reason"] == "wrong answer"


def test_only_the_last_box_counts():
    # math-verify alone would make {2, 3} of these two boxes; only the final one is the answer.
    assert grade_math(r"First \boxed{2}, then finally \boxed{3}", "3", CFG).correct
    v = grade_math(r"First \boxed{3}, then finally \boxed{2}", "3", CFG)
    assert not v.correct and v.details["extracted"] == "2"


def test_box_inside_thinking_does_not_count():
    v = grade_math("<think>it is \\boxed{3}</think>I am not sure.", "3", CFG)
    assert not v.correct
    v = grade_math("<think>it is \\boxed{3} and I keep thinking", "3", CFG)
    assert not v.correct and "never closed" in v.details["reason"]


def test_no_box_fallback_and_require_box():
    v = grade_math("We add them. The final answer is 42.", "42", CFG)
    assert v.correct and v.details["source"].startswith("fallback")
    # The fallback takes the LAST expression of the answer text.
    assert not grade_math("We get 3, then check 4.", "3", CFG).correct
    strict = RewardConfig(math_require_box=True)
    v = grade_math("The final answer is 42.", "42", strict)
    assert not v.correct and "boxed" in v.details["reason"]


def test_custom_rewards_and_unparsable_reference():
    cfg = RewardConfig(correct_reward=1.0, wrong_reward=0.0)
    assert grade_math(r"\boxed{2}", "2", cfg).reward == 1.0
    assert grade_math(r"\boxed{3}", "2", cfg).reward == 0.0
    v = grade_math(r"\boxed{2}", "", cfg)
    assert not v.correct and "not parsable" in v.details["reason"]


def test_the_timeout_is_the_backstop_and_gives_a_verdict():
    cfg = RewardConfig(math_timeout_s=1e-4)     # shorter than any parse
    v = grade_math(r"\boxed{\frac{x^2-1}{x-1}}", "x+1", cfg)
    assert not v.correct and v.reward == cfg.wrong_reward
    assert v.details["reason"].startswith("timeout")


def test_grading_off_the_main_thread_still_verifies():
    # math-verify's default signal timeouts raise ValueError off the main thread; ours must not
    # silently turn correct answers into zeros there.
    out = []
    t = threading.Thread(target=lambda: out.append(grade_math(r"\boxed{\frac{2}{4}}", "0.5", CFG)))
    t.start()
    t.join(60)
    assert out and out[0].correct, out


def test_last_boxed_and_answer_text():
    assert last_boxed(r"\boxed{a} \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\fbox{5} and \boxed{6") == "5"
    assert last_boxed("no box") is None
    assert answer_text("<think>a</think>b</think>c") == "c"
    assert answer_text("<think>a") is None
    assert answer_text("plain") == "plain"


def test_extract_program_order():
    r = "```python\nA\n```\ntext\n```cpp\nB\n```\n```py\nC\n```"
    assert extract_program(r) == ("C\n", "last ```python block")
    assert extract_program("```\nX\n```")[0] == "X\n"
    assert extract_program("def f(x): return x")[0] == "def f(x): return x"
    assert extract_program("<think>```python\nA\n```")[0] is None
    assert extract_program("<think>```python\nA\n```</think>")[0] is None


def test_a_reference_with_a_decimal_comma_reads_both_ways():
    """`1,22` is 1 and 22 in an English data set and 1.22 in a European one (math-verify's
    own labelled case); a thousands comma and a spaced list keep their one reading."""
    decimal = grade_math(r"\boxed{1.22}", "1,22", CFG)
    assert decimal.correct and "decimal comma" in decimal.details["source"]
    assert grade_math(r"\boxed{22, 1}", "1,22", CFG).correct
    assert not grade_math(r"\boxed{1.23}", "1,22", CFG).correct
    assert not grade_math(r"\boxed{1.22}", "1, 22", CFG).correct
    assert not grade_math(r"\boxed{1.0}", "1,000", CFG).correct
