"""The answer contract of training rewards: one final answer, graded at a bounded cost.

A policy optimises whatever the reward lets through. Two holes found by trying (issues 22, 32):
- **Hedging.** "I get either 12 or 13. The answer is 12 or 13." scored right against 12 (plain
  math-verify accepts it too): a policy that names its two best guesses doubles its reward
  without learning anything. So where the reference is one value, an answer that offers several
  is wrong. What "offers several" means is read from the answer's structure
  (answer_structure.py), not from a list of separator words: `\\vee`, `∨`, `\\mid`, a line break,
  "OR", "12 and 13", a box inside a box, a hedge after the box and an answer by cases are all
  several values, while LaTeX's spaces (`5\\,\\text{cm}`, `1\\,000`) and a trailing clause ("12,
  as required") are not. A chain of relations is graded on every side (issue 61: math-verify
  reads one, so `12 \\approx 13`, `12 \\Rightarrow 13` and `x = 12 \\vee x = 13` passed for
  either number): `12 = 13` offers both, `f(2) = 7` and `3 \\cdot 4 = 12` one. Where the reference has several values
  itself (roots, an interval, ±) the matching forms are left to math-verify. Several boxes are
  fine when the text before the last one concludes or corrects ("wait", "actually", "so",
  "finally", "therefore", ...): the last one is the answer.
- **Answers that cost seconds.** Checked on the text and on the parsed tree before anything is
  evaluated (answer_cost.py).
"""
from __future__ import annotations

import re

from tandem.reward.answer_structure import ALTERNATION, despace, offered

# 1,000 and LaTeX's 14{,}916 and 11,\! 111 are one number
_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\\!\s*|,)(?=\d{3}(?!\d))")
_BRACKETED = re.compile(r"^\s*[\[(].*,.*[\])]\s*$", re.DOTALL)   # an interval or a tuple: [2,714)
_SEVERAL = re.compile(r"\\text\s*\{\s*or\s*\}|\bor\b|\\lor|\\pm|\\mp|\\cup|\\\{|[,;]")
_STATED = re.compile(r"\banswer\s*(?:is|:|=)\s*", re.IGNORECASE)
_CONCLUDES = re.compile(r"\b(wait|actually|correct(ion|ed|ing)?|mistake|wrong|instead|rather|re-?check\w*|"
                        r"redo|finally|final|therefore|thus|hence|so|answer)\b", re.IGNORECASE)
_LINE_READ = 1000          # characters of the line after the answer read for another value
MAX_SIDES = 8              # sides of one chain of relations (each is parsed alone)
_APPROX = re.compile(r"\\approx|≈|\\simeq|\\doteq")
_SENTENCE_END = re.compile(r"[.!?](?![\d=])|\n")     # 3.5 and x != 5 go on, "is 3." ends a sentence


def several_values(reference: str) -> bool:
    """Whether the reference answer's text holds more than one value (roots, a set, an
    interval, ±, "or"); then the matching multi-value forms of an answer are legitimate. The
    grader also asks its parsed form (math_grader.py), which sees `\\boxed{1}\\boxed{2}` too."""
    reference = despace(reference)
    return bool(_BRACKETED.match(reference)) or _SEVERAL.search(_THOUSANDS.sub("", reference)) is not None


def hedge(final: str, several: bool, prose: bool = False) -> str | None:
    """Why `final` (the graded answer: a box's content, or with `prose` an answer sentence)
    offers several candidates where the reference is one value (`several` False)."""
    return None if several else offered(final, prose=prose)


def hedge_after(text: str, end: int, answer: str, several: bool, boxed: bool = True) -> str | None:
    """Why the line that goes on after the answer offers another value ("\\boxed{12}, or
    possibly 13", "\\boxed{12}. Or 13.", "The answer is 12. Or 13."); `end`: where the answer
    (the box, else the answer sentence) ends in `text`. The line, not the rest of the text: a
    list or a new paragraph after the answer is not an alternative."""
    if several:
        return None
    rest = text[end:end + _LINE_READ].split("\n", 1)[0]
    if boxed:
        rest = re.sub(r"^\s*(?:\$\$?|\\\]|\\\))", " ", rest)     # the math the box stood in closes
        answer = f"${answer}$"
    return offered(f"{answer} {rest}", prose=True, joiners=ALTERNATION if boxed else None) \
        if rest.strip(" $\\])}.") else None


def every_side(sides: list[tuple[str, str]], is_name, is_answer) -> str | None:
    """Why a chain of relations (answer_structure.relation_sides: `x = 12 \\approx 13`,
    `12 \\Rightarrow 13`, `x = 12 \\vee x = 13`) offers more than the answer: it is graded on
    every side, where math-verify reads one (the left of `\\approx`, the last of an unparsable
    chain). A side may name what the answer is about (`x`, `f(2)`: `is_name(side)`), the last
    excepted; every other side must be the answer (`is_answer(side, approximate)`, approximate
    beside `\\approx`). `12 = 13` and `3 \\cdot 4 = 13` are hedges; `3 \\cdot 4 = 12`, `f(2) = 7`
    and `\\sqrt{2} \\approx 1.414` are one answer."""
    if len(sides) < 2:
        return None
    if len(sides) > MAX_SIDES:
        return f"hedged: a chain of {len(sides)} relations (limit {MAX_SIDES})"
    rest = [r for r, _ in sides[1:]] + [""]
    wrong = [side for i, ((before, side), after) in enumerate(zip(sides, rest, strict=True))
             if (i == len(sides) - 1 or not is_name(side))
             and not is_answer(side, _APPROX.search(before + " " + after) is not None)]
    if not wrong:
        return None
    return f"hedged: a relation offers {wrong[0][:40]!r} besides the answer (every side is graded)" \
        if len(wrong) < len(sides) else "wrong answer"


def disagreeing_boxes(text: str, boxes: list[tuple[int, str]], several: bool) -> str | None:
    """Why boxes that disagree are a hedge (where the reference is one value): the last one
    does not follow a conclusion or a correction. `boxes`: (position, content) of every complete
    box of the answer text."""
    if len(boxes) < 2 or several:
        return None
    (prev_at, prev), (last_at, last) = boxes[-2], boxes[-1]
    if _norm(prev) == _norm(last) or _CONCLUDES.search(text[prev_at:last_at]):
        return None
    return f"hedged: boxes {prev[:40]!r} and {last[:40]!r} disagree with nothing settling between them"


def final_sentence(text: str) -> str:
    """What an answer without a box states as its answer: the last sentence that names the
    answer ("The final answer is 42."), else the last sentence."""
    parts = [p.strip() for p in _SENTENCE_END.split(text) if p and p.strip()]
    named = [p for p in parts if re.search(r"\banswer\b", p, re.IGNORECASE)]
    return (named or parts or [""])[-1]


def stated_after_last_box(text: str, box_end: int) -> str | None:
    """The answer sentence ("The final answer is 10,455.") that follows the last box, if one
    does: the box was an intermediate value, the sentence states the answer. `box_end`: where
    the last box closes in `text`."""
    rest = text[box_end:]
    return final_sentence(rest) if _STATED.search(rest) else None


def _norm(s: str) -> str:
    return re.sub(r"\s+", "", s)
