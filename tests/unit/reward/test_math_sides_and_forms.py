"""Issue 61's math cases and the variants a policy would try next: wrong answers graded right
(a relation graded on one side, a percent where none is asked, floats rounded to 6 decimals on
both sides, units dropped on both sides) and right answers graded wrong (forms math-verify
misreads: answer_forms.py, question_forms.py, the answer's structure)."""
from __future__ import annotations

import pytest

from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math

CFG = RewardConfig(math_timeout_s=5.0)
COUNT = "How many apples are left in the basket?"
PERCENT = "What percent of the class passed the test?"

# A relation chain offers every value it relates: graded on every side, for either reference.
CHAINS = [r"x = 12 \vee x = 13", r"x = 12 \lor x = 13", r"x = 12 \wedge x = 13", "x=12 ∨ x=13",
          r"12 \approx 13", "12 ≈ 13", r"12 \Rightarrow 13", r"12 \implies 13", r"12 \iff 13", r"12 \to 13",
          r"12 \rightarrow 13", r"12 \longrightarrow 13", "12 → 13", r"12 \mapsto 13", r"12 \sim 13",
          r"12 \simeq 13", r"12 \cong 13", r"12 \equiv 13", r"12 \le 13", "12 < 13", "12 = 13",
          r"x = 12 \Rightarrow x = 13", r"a = 12 \approx 13", r"12 \approx 12.4 \approx 13"]


@pytest.mark.parametrize("gold", ["12", "13"])
@pytest.mark.parametrize("chain", CHAINS)
def test_a_relation_chain_is_graded_on_every_side(gold, chain):
    for response in (rf"\boxed{{{chain}}}", f"The answer is ${chain}$.", f"The answer is {chain}."):
        v = grade_math(response, gold, CFG)
        assert not v.correct and v.details["reason"].startswith("hedged"), (response, v.details)


@pytest.mark.parametrize("gold, response", [
    ("13", r"\boxed{x = 12 \curlyvee x = 13}"),      # a connective nobody listed
    ("13", r"\boxed{12 \lll 13}"),
    ("13", r"\boxed{12 \dashv 13}"),
    ("13", r"\boxed{3 \cdot 4 = 13}"),
    ("12", r"\boxed{2x = 24}"),
])
def test_a_value_read_out_of_a_box_is_not_its_answer(gold, response):
    assert not grade_math(response, gold, CFG).correct


@pytest.mark.parametrize("gold, response", [
    ("7", r"\boxed{f(2) = 7}"),                      # a function's value, not a false equation
    ("7", r"\boxed{g(3) = 7}"),
    (r"\frac{1}{2}", r"\boxed{P(A) = \frac{1}{2}}"),
    ("12", r"\boxed{a_5 = 12}"),
    ("12", r"\boxed{x = \frac{24}{2} = 12}"),
    ("12", r"\boxed{3 \cdot 4 = 12}"),
    ("45", r"\boxed{\angle ABC = 45^\circ}"),
    (r"12\pi", r"\boxed{2\pi r = 12\pi}"),
    (r"\sqrt{2}", r"\boxed{\sqrt{2} \approx 1.414}"),     # an approximation of the answer itself
    (r"\pi", r"\boxed{\pi \approx 3.14}"),
    ("7", "The answer is $f(2) = 7$."),
    ("2", r"\boxed{f^{-1}(3) = 2}"),
    (r"\frac14", r"\boxed{P(X=2) = \frac{1}{4}}"),
    ("55", r"\boxed{S_{10} = 55}"),
    ("5", r"\boxed{x := 5}"),
])
def test_a_relation_whose_every_side_is_the_answer_is_right(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details


@pytest.mark.parametrize("response", [r"\boxed{12\%}", r"\boxed{12 \%}", r"\boxed{12%}", "The answer is 12%.",
                                      r"\boxed{12\text{\%}}", r"\boxed{12 \text{ percent}}", "The answer is 12 percent."])
def test_a_percent_where_none_is_asked_is_its_fraction(response):
    v = grade_math(response, "12", CFG, question=COUNT)
    assert not v.correct, v.details
    assert grade_math(r"\boxed{12\%}", "0.12", CFG, question="What is the probability of rain?").correct


@pytest.mark.parametrize("gold, response", [
    ("12.5", r"\boxed{12.5\%}"), ("12.5", r"\boxed{12.5 \%}"), ("33.3", r"\boxed{33.3\%}"),
    ("12.5", "The answer is 12.5%."), ("25", r"\boxed{25\%}"), ("12.5", r"\boxed{12.5}"),
])
def test_a_percent_answers_a_percent_question(gold, response):
    v = grade_math(response, gold, CFG, question=PERCENT)
    assert v.correct, v.details
    assert not grade_math(r"\boxed{0.125}", "12.5", CFG, question=PERCENT).correct


@pytest.mark.parametrize("gold, response", [
    ("1/3000000", r"\boxed{0.0}"), ("1/3000000", r"\boxed{0.000000}"), ("1/3000000", r"\boxed{0.0000003}"),
    (r"\frac{1}{7000000}", r"\boxed{0.0}"), ("0.0000001", r"\boxed{0}"), ("0.0000001", r"\boxed{0.0}"),
    ("1.5e-7", r"\boxed{1e-7}"), ("1.5e-7", r"\boxed{0.0000002}"),
])
def test_a_small_number_is_compared_to_its_significant_digits(gold, response):
    v = grade_math(response, gold, CFG)
    assert not v.correct, v.details


@pytest.mark.parametrize("gold, response", [
    ("1/3000000", r"\boxed{0.000000333333}"), ("1/3000000", r"\boxed{3.333333e-7}"), ("1/3", r"\boxed{0.333333}"),
    ("0.00001", r"\boxed{10^{-5}}"), ("2.5", r"\boxed{2.5000001}"),
])
def test_a_small_number_written_to_its_digits_is_right(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details


@pytest.mark.parametrize("gold, response, right", [
    (r"5\text{ m}", r"\boxed{5\text{ cm}}", False), (r"5\,\mathrm{m}", r"\boxed{5\,\mathrm{cm}}", False),
    (r"5\text{ m}", r"\boxed{5\text{ km}}", False), (r"5\text{ m}", r"\boxed{5\text{ m}^2}", False),
    (r"5\text{ m}", r"\boxed{\text{5 cm}}", False), (r"5\text{ minutes}", r"\boxed{5\text{ seconds}}", False),
    (r"5\text{ m}", r"\boxed{5 \mathrm{~cm}}", False), (r"5\,\mathrm{km/h}", r"\boxed{5\,\mathrm{m/s}}", False),
    (r"5\text{ m}", "The answer is 5 cm.", False), (r"5\text{ m}", "The answer is 5 meters.", True),
    (r"5\text{ m}", r"\boxed{5\text{ meters}}", True), (r"5\text{ m}", r"\boxed{5}", True),
    ("5", r"\boxed{5\text{ m}}", True), (r"5\text{ m}^2", r"\boxed{5\text{ square meters}}", True),
    (r"5\text{ cm}", r"\boxed{5\text{ cm}}", True),
])
def test_a_unit_both_sides_state_is_the_same_unit(gold, response, right):
    v = grade_math(response, gold, CFG)
    assert v.correct is right, v.details


@pytest.mark.parametrize("gold, response", [
    (r"\log_{2} 5", r"\boxed{\log_2 5}"), ("2", r"\boxed{\log_{10} 100}"), ("2", r"\boxed{\log_3 9}"),
    ("1500000", r"\boxed{1.5e6}"), ("1500000", r"\boxed{1.5E6}"), ("0.0003", r"\boxed{3e-4}"),
    ("2500", r"\boxed{2.5e+3}"), ("1500000", "The answer is 1.5e6."),
    ("45", r"\boxed{45°}"), ("45", r"\boxed{45\degree}"), ("45", r"\boxed{45^{\circ}}"), ("45", r"\boxed{45 °}"),
    ("45", r"\boxed{45^°}"), ("45", r"\boxed{45\textdegree}"), (r"45^\circ", r"\boxed{45°}"), ("45°", r"\boxed{45}"),
    ("42", r"\boxed{42.}"), ("42", r"\boxed{x = 42.}"), ("3.5", r"\boxed{3.5.}"),
    (r"\frac{-1+\sqrt{5}}{2}, \frac{-1-\sqrt{5}}{2}", r"\boxed{\frac{-1 \pm \sqrt{5}}{2}}"),
    (r"\frac{-1-\sqrt{5}}{2}, \frac{-1+\sqrt{5}}{2}", r"\boxed{\frac{-1 \pm \sqrt{5}}{2}}"),
    (r"\frac{-1 \pm \sqrt{5}}{2}", r"\boxed{\frac{-1+\sqrt{5}}{2}, \frac{-1-\sqrt{5}}{2}}"),
    (r"1+\sqrt{2}, 1-\sqrt{2}", r"\boxed{1 \pm \sqrt{2}}"), (r"1+\sqrt{2}, 1-\sqrt{2}", r"\boxed{x = 1 \pm \sqrt{2}}"),
    ("3, -3", r"\boxed{\pm 3}"), (r"\frac{1 \mp \sqrt{3}}{2}", r"\boxed{\frac{1 \pm \sqrt{3}}{2}}"),
    (r"\frac{-1+\sqrt{5}}{2}, \frac{-1-\sqrt{5}}{2}", r"\boxed{x_{1,2} = \frac{-1 \pm \sqrt{5}}{2}}"),
    (r"\frac{-1+\sqrt{5}}{2}, \frac{-1-\sqrt{5}}{2}", r"\boxed{\frac{1}{2}(-1 \pm \sqrt{5})}"),
    (r"\frac13", r"\boxed{0.\overline{3}}"), (r"\frac16", r"\boxed{0.1\overline{6}}"), (r"\frac17", r"\boxed{0.\overline{142857}}"),
    (r"\frac43", r"\boxed{1.\overline{3}}"), (r"\frac13", r"\boxed{0.\bar{3}}"), (r"\frac13", r"\boxed{0.\dot{3}}"),
    (r"-\frac13", r"\boxed{-0.\overline{3}}"), (r"0.\overline{3}", r"\boxed{\frac{1}{3}}"),
    (r"\varnothing", r"\boxed{\emptyset}"), (r"\emptyset", r"\boxed{\varnothing}"), (r"\emptyset", r"\boxed{∅}"),
    (r"\varnothing", r"\boxed{\{\}}"), (r"\varnothing", r"\boxed{\{\ \}}"),
    (r"(-\infty,-1)\cup(1,\infty)", r"\boxed{(-\infty,-1) \lor (1,\infty)}"),
    (r"(-\infty,-1)\cup(1,\infty)", r"\boxed{(-\infty,-1) \vee (1,\infty)}"),
    (r"(-\infty,-1)\cup(1,\infty)", r"\boxed{(-\infty,-1) \text{ or } (1,\infty)}"),
    ("B", "The answer is (B)."), ("B", "The correct answer is B."), ("C", "**Answer: (C)**"),
    ("B", r"The answer is \textbf{(B)}."), ("(B)", "The answer is B."), ("B", "The answer is option B."),
    ("B", "The answer is choice (B)."), ("B", "**(B)**"), ("45", r"\boxed{45 \text{ degrees}}"), ("42", r"\boxed{\$42.}"),
])
def test_forms_math_verify_misreads_are_right(gold, response):
    v = grade_math(response, gold, CFG)
    assert v.correct, v.details


@pytest.mark.parametrize("gold, response", [
    ("B", "The answer is (C)."), ("B", "The answer is (B) or (C)."), ("1500000", r"\boxed{1.5e5}"),
    ("45", r"\boxed{46°}"), (r"\frac13", r"\boxed{0.\overline{6}}"), (r"\emptyset", r"\boxed{\{0\}}"),
    ("3", r"\boxed{\pm 3}"), (r"1+\sqrt{2}, 1-\sqrt{2}", r"\boxed{1 + \sqrt{2}}"),
])
def test_the_same_forms_with_another_value_stay_wrong(gold, response):
    v = grade_math(response, gold, CFG)
    assert not v.correct, v.details


def test_an_option_letter_in_a_sentence_answers_by_its_value():
    question = r"Which is prime? $\textbf{(A) }4\qquad\textbf{(B) }7\qquad\textbf{(C) }9$"
    assert grade_math("The answer is (B).", "7", CFG, question=question).correct
    assert not grade_math("The answer is (C).", "7", CFG, question=question).correct
