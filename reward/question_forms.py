"""What the question asks for, where it changes what a right answer looks like.

Forms a careful human grader reads from the problem and math-verify cannot, since it sees
only the reference and the response:
- **Options**: a multiple-choice problem (`(A) 5 \\qquad (B) 6`, or one option per line as
  `A. 5`) is answered by a letter or by the option's value; either names the same choice. A
  reference that is itself a letter is answered by that letter however it is written
  (`\\boxed{B}`, "The answer is (B).").
- **A percent asked for**: "What percent of 80 is 20?" is answered by 25 or 25%, not by 0.25;
  math-verify alone accepts 0.25 for a reference of `25\\%` (and elsewhere it should: "the
  probability is 25%" answers 0.25). There `12.5%` answers a bare reference `12.5`.
- **No percent at all in the question**: a percent sign in the answer is a division by 100
  (`12%` is 0.12, not the count 12, which math-verify alone also reads it as: issue 61). Without
  the question, or where it speaks of percents without asking for one, math-verify reads it.
"""
from __future__ import annotations

import re

_MARK = re.compile(r"(?:\\textbf\s*\{\s*|\\mathrm\s*\{\s*)?\(\s*([A-E])\s*\)\s*\}?")
_LINE_OPTION = re.compile(r"(?m)^\s*\(?([A-E])[.):]\s+(.+?)\s*$")
_SPACING = re.compile(r"\\q?quad|\\[ ,;!]|\\text\s*\{\s*\}|~")
_LETTER = re.compile(r"\s*(?:\\(?:textbf|text|mathrm|mathbf)\s*\{\s*)?\(?\s*([A-E])\s*\)?\s*\}?"
                     r"(?![A-Za-z])(.*)", re.DOTALL)
_CHOICE = re.compile(r"^\s*(?:option|choice)\s+", re.IGNORECASE)
_ASKS_PERCENT = re.compile(r"\b(?:what|which)\s+(?:\w+\s+){0,3}?percent(?:age)?\b|\bas\s+a\s+percent(?:age)?\b|"
                           r"\bhow\s+many\s+percent\b|\bin\s+percent\b|\bnearest\s+(?:whole\s+|tenth\s+of\s+a\s+)?percent\b",
                           re.IGNORECASE)
_PERCENT = re.compile(r"\\?%|\\percent\b|\bpercent\b")
_PERCENT_SIGN = re.compile(r"\s*(?:\\(?:text|mathrm|textrm)\s*\{\s*(?:\\?%|percent)\s*\}|\\?%|\\percent\b|\bpercent\b)")


def options(question: str) -> dict[str, str]:
    """The listed options by letter, or {} when the question lists none (at least A and B,
    in order, each once)."""
    marks = list(_MARK.finditer(question))
    if _in_order([m.group(1) for m in marks]):
        out = {}
        for mark, after in zip(marks, [*marks[1:], None], strict=True):
            end = after.start() if after else _line_end(question, mark.end())
            out[mark.group(1)] = _clean(question[mark.end():end])
        return out
    lines = _LINE_OPTION.findall(question)
    if _in_order([letter for letter, _ in lines]):
        return {letter: _clean(value) for letter, value in lines}
    return {}


def option_named(answer: str, listed: dict[str, str]) -> str | None:
    """The letter an answer names (`B`, `(B)`, `\\textbf{(B)}\\ 6`), if it is one of `listed`."""
    got = _LETTER.fullmatch(answer)
    if not got or got.group(1) not in listed:
        return None
    rest = _clean(got.group(2))
    # "(B) 6" names B only if 6 is B's value; a bare letter names it outright.
    return got.group(1) if not rest or _clean(rest) == listed[got.group(1)] else None


def letter(answer: str) -> str | None:
    """The option letter an answer is and nothing more (`B`, `(B)`, `\\textbf{(B)}`), or None."""
    got = _LETTER.fullmatch(_CHOICE.sub("", answer))
    return got.group(1) if got and not _clean(got.group(2)).strip("*") else None


def asks_percent(question: str) -> bool:
    return bool(_ASKS_PERCENT.search(question))


def has_percent(text: str) -> bool:
    return bool(_PERCENT.search(text))


def without_percent(reference: str) -> str:
    return _PERCENT.sub("", reference).strip()


def percent_as_fraction(answer: str) -> str:
    """`answer` with each percent sign read as a division by 100 (`12\\%` is `12/100`)."""
    return _PERCENT_SIGN.sub(r" \\cdot \\frac{1}{100}", answer)


def _in_order(letters: list[str]) -> bool:
    return len(letters) >= 2 and letters == [chr(ord("A") + i) for i in range(len(letters))]


def _line_end(text: str, start: int) -> int:
    ends = [i for i in (text.find("\n", start), text.find("$", start)) if i >= 0]
    return min(ends, default=len(text))


def _clean(value: str) -> str:
    return _SPACING.sub(" ", value).strip(" \t\n$,;.")
