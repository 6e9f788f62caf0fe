"""Finding the answer is linear in the response, whatever it holds (issue 32): a fence followed
by 100 KB with no newline cost 7 s in a backtracking regex, 12,000 unclosed `\\boxed{` openings
15 s of one scan per opening. Asserted by the work done (characters scanned, passes over the
text), not by the clock; benchmarks/reward_attacks.py times the same inputs."""
from __future__ import annotations

import pytest

import tandem.reward.extract as extract
from tandem.reward.config import RewardConfig
from tandem.reward.extract import box_spans, boxes, extract_program, fenced_blocks
from tandem.reward.math_grader import grade_math


class ScanCounter(str):
    """A response that counts the characters its `find` calls pass over."""

    scanned = 0

    def find(self, sub, start=0, end=None):
        at = str.find(self, sub, start, len(self) if end is None else end)
        type(self).scanned += (len(self) if at < 0 else at + len(sub)) - start
        return at


@pytest.mark.parametrize("response", [
    "```" + "a" * 100_000,                        # a fence line that never ends
    "```python\n" + "x = 1\n" * 20_000,            # a block that never closes
    "```\n" * 30_000,                              # fences and nothing else
    ("```" + "a" * 50) * 2_000 + "\n",
])
def test_fenced_blocks_scan_each_character_a_bounded_number_of_times(response):
    ScanCounter.scanned = 0
    text = ScanCounter(response)
    fenced_blocks(text)
    assert ScanCounter.scanned <= 2 * len(response) + 8


def test_a_fence_with_no_newline_is_no_block_and_the_answer_is_the_whole_text():
    attack = "```" + "a" * 100_000
    assert fenced_blocks(attack) == ([], "")
    assert extract_program(attack) == (attack, "whole answer (no fenced block)")


@pytest.mark.parametrize("response, expected", [
    ("```python\nA\n```\ntext\n```cpp\nB\n```\n```py\nC\n```", ("C\n", "last ```python block")),
    ("```\nX\n```", ("X\n", "last fenced block (no python tag)")),
    ("intro ```py\nprint(1)", ("print(1)", "unclosed fence")),
    ("``` a ``` b\nbody", ("body", "unclosed fence")),
    ("````\nX\n````", ("X\n", "last fenced block (no python tag)")),
])
def test_extraction_keeps_its_rules(response, expected):
    assert extract_program(response) == expected


def test_boxes_match_every_brace_in_one_pass(monkeypatch):
    calls = []
    real = extract._brace_pairs
    monkeypatch.setattr(extract, "_brace_pairs", lambda text: calls.append(len(text)) or real(text))
    attack = r"\boxed{" * 12_000
    assert boxes(attack) == []
    nested = r"\boxed{" * 12_000 + "1" + "}" * 12_000
    (start, end, content), = box_spans(nested)       # one outermost box; the others are inside it
    assert start == 0 and end == len(nested) - 1 and content.startswith(r"\boxed{")
    assert calls == [len(attack), len(nested)]


def test_unclosed_box_openings_are_graded_quickly_as_no_answer():
    v = grade_math(r"\boxed{" * 12_000, "1", RewardConfig(math_timeout_s=2.0, math_require_box=True))
    assert not v.correct and "boxed" in v.details["reason"]


def test_box_positions_and_contents():
    text = r"a \boxed{1} b \fbox{\{2\}} c \boxed{\boxed{3}} d \boxed{4"
    assert boxes(text) == [(2, "1"), (14, r"\{2\}"), (29, r"\boxed{3}")]
    assert [text[end] for _, end, _ in box_spans(text)] == ["}", "}", "}"]


def test_nested_boxes_are_graded_with_one_scan(monkeypatch):
    """12,000 nested boxes: one pass finds the outermost box, whose content is refused by its
    length; it is not unwrapped box by box (one scan per level: quadratic)."""
    import tandem.reward.math_grader as grader
    calls = []
    real = grader.box_spans
    monkeypatch.setattr(grader, "box_spans", lambda text: calls.append(len(text)) or real(text))
    nested = r"\boxed{" * 12_000 + "1" + "}" * 12_000
    v = grade_math(nested, "1", RewardConfig(math_timeout_s=2.0))
    assert not v.correct and v.details["reason"].startswith("too costly"), v.details
    assert calls == [len(nested)]
    assert grade_math(r"\boxed{\boxed{12}}", "12", RewardConfig(math_timeout_s=2.0)).correct
