"""The answer contract of training rewards: one final answer, graded at a bounded cost.

A policy optimises whatever the reward lets through. Two holes found by trying (issue 22):
- **Hedging.** "I get either 12 or 13. The answer is 12 or 13." scored right against 12 (plain
  math-verify accepts it too): a policy that names its two best guesses doubles its reward
  without learning anything. So where the reference is one value, an answer that offers several
  — "X or Y", a list, a set, an interval, ±, boxes that disagree — is wrong. Where the reference
  has several values itself (roots, an interval, ±) the matching forms are left to math-verify.
  Several boxes are fine when the text before the last one concludes or corrects ("wait",
  "actually", "so", "finally", "therefore", ...): the last one is the answer.
- **Answers that cost seconds.** `\\boxed{9^{9^{9^{9}}}}` held a grader worker for its whole
  timeout; a batch of them stalls the reward service and the run. So before any symbolic work
  the answer's size and shape are checked — its length, its nesting, the digits a numeric power
  or factorial would have — and a pathological one is wrong within microseconds. The
  per-answer timeout stays as the backstop.
"""
from __future__ import annotations

import math
import re

MAX_CHARS = 1000          # an answer longer than this is not a final answer
MAX_DEPTH = 30            # brackets nested deeper than this
MAX_DIGITS = 10_000       # a number this long (a power or factorial) is not computed
MAX_SYMBOLIC_EXPONENT = 50     # (x+1)^{999} takes seconds to compare, (x+1)^{100} half of one

# 1,000 and LaTeX's 14{,}916 and 11,\! 111 are one number
_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\\!\s*|,)(?=\d{3}(?!\d))")
_BRACKETED = re.compile(r"^\s*[\[(].*,.*[\])]\s*$", re.DOTALL)   # an interval or a tuple: [2,714)
_SEVERAL_WORDS = r"\\text\s*\{\s*or\s*\}|\bor\b|\\lor|\\pm|\\mp|\\cup|\\\{"
_SEVERAL = re.compile(_SEVERAL_WORDS + r"|[,;]")
_SEVERAL_IN_PROSE = re.compile(_SEVERAL_WORDS)     # a sentence's commas are its grammar
_STATED = re.compile(r"\banswer\s*(?:is|:|=)\s*", re.IGNORECASE)
_CONCLUDES = re.compile(r"\b(wait|actually|correct(ion|ed|ing)?|mistake|wrong|instead|rather|re-?check\w*|"
                        r"redo|finally|final|therefore|thus|hence|so|answer)\b", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?![\d=])|\n")     # 3.5 and x != 5 go on, "is 3." ends a sentence
_FACTORIAL = re.compile(r"(\d+)\s*!")


def several_values(reference: str) -> bool:
    """Whether the reference answer's text holds more than one value (roots, a set, an
    interval, ±, "or"); then the matching multi-value forms of an answer are legitimate. The
    grader also asks its parsed form (math_grader.py), which sees `\\boxed{1}\\boxed{2}` too."""
    return bool(_BRACKETED.match(reference)) or _SEVERAL.search(_THOUSANDS.sub("", reference)) is not None


def hedge(final: str, several: bool, prose: bool = False) -> str | None:
    """Why `final` (the graded answer: a box's content, or with `prose` an answer sentence)
    offers several candidates where the reference is one value (`several` False)."""
    if several:
        return None
    if prose:   # "So, the answer is 42": judge what follows "answer is", else only "or", ±, ...
        stated = _STATED.split(final)
        final, pattern = (stated[-1], _SEVERAL) if len(stated) > 1 else (final, _SEVERAL_IN_PROSE)
    else:
        pattern = _SEVERAL
    m = pattern.search(_THOUSANDS.sub("", final))
    return None if m is None else f"hedged: several candidates ({m.group(0).strip()!r}) for a one-value reference"


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


def stated_after_last_box(text: str, boxes: list[tuple[int, str]]) -> str | None:
    """The answer sentence ("The final answer is 10,455.") that follows the last box, if one
    does: the box was an intermediate value, the sentence states the answer."""
    if not boxes:
        return None
    at, content = boxes[-1]
    rest = text[text.find(content, at) + len(content):]
    return final_sentence(rest) if _STATED.search(rest) else None


def too_costly(answer: str) -> str | None:
    """Why grading `answer` could take more than milliseconds of symbolic work, or None."""
    if len(answer) > MAX_CHARS:
        return f"too costly: an answer of {len(answer)} characters (limit {MAX_CHARS})"
    depth = deepest = 0
    for c in answer:
        depth += c in "{(["
        depth -= c in "})]"
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        return f"too costly: brackets nested {deepest} deep (limit {MAX_DEPTH})"
    for m in _FACTORIAL.finditer(answer):
        n = int(m.group(1)) if len(m.group(1)) < 12 else 10 ** 12
        if n > 10 and _log10_factorial(n) > MAX_DIGITS:
            return f"too costly: {m.group(1)}! has about {_log10_factorial(n):.3g} digits"
    i = answer.find("^")
    while i >= 0:
        why = _power_problem(answer, i)
        if why:
            return why
        i = answer.find("^", i + 1)
    return None


def _power_problem(text: str, caret: int) -> str | None:
    exponent, _ = _group_after(text, caret + 1)
    value = _numeric_value(exponent)
    if value is None:
        return None
    base = _number_before(text, caret)
    if base is None:   # a symbolic base: the exponent is what expansion costs
        if value > MAX_SYMBOLIC_EXPONENT:
            return f"too costly: a power with exponent {value:.3g} (limit {MAX_SYMBOLIC_EXPONENT})"
        return None
    digits = value * math.log10(base) if base > 1 else 0.0
    if digits > MAX_DIGITS:
        return f"too costly: a power with about {digits:.3g} digits (limit {MAX_DIGITS})"
    return None


def _group_after(text: str, i: int) -> tuple[str, int]:
    """The exponent starting at text[i]: a {braced} group, or one character (LaTeX's `^2`)."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth, j = 0, i
        while j < len(text):
            depth += text[j] == "{"
            depth -= text[j] == "}"
            if depth == 0:
                return text[i + 1:j], j + 1
            j += 1
        return text[i + 1:], len(text)
    m = re.match(r"\d+(\.\d+)?", text[i:])     # plain-text answers write 10^100
    if m:
        return m.group(0), i + m.end()
    return text[i:i + 1], i + 1


def _numeric_value(expr: str) -> float | None:
    """The value of a purely numeric tower like `9^{9^{9}}` (inf when it overflows), or None."""
    expr = expr.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:\^\s*(.+))?", expr, re.DOTALL)
    if m is None:
        return None
    base = float(m.group(1))
    if m.group(2) is None:
        return base
    inner = m.group(2).strip()
    inner = inner[1:-1] if inner.startswith("{") and inner.endswith("}") else inner
    exponent = _numeric_value(inner)
    if exponent is None:
        return None
    try:
        return base ** exponent
    except OverflowError:
        return math.inf


def _number_before(text: str, caret: int) -> float | None:
    m = re.search(r"(\d+(?:\.\d+)?)\s*$", text[:caret])
    if m is None or (m.start() > 0 and re.match(r"[A-Za-z_)}\]]", text[m.start() - 1])):
        return None
    return float(m.group(1))


def _log10_factorial(n: int) -> float:
    return math.lgamma(n + 1) / math.log(10)


def _norm(s: str) -> str:
    return re.sub(r"\s+", "", s)
