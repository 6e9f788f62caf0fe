"""Math verdicts: math-verify on the final answer of a reasoning model's response.

math-verify's own timeouts use `signal.alarm` and raise ValueError off the main thread (callers
that catch it and score 0 silently zero their rewards), so they are always disabled here. Time
is bounded instead by an interval timer of our own when grading on the main thread, and, in the
service, by the pool killing a worker that overruns (see reward.pool). Either way a timeout
becomes a verdict with reason "timeout", never a silent zero.
"""
from __future__ import annotations

import logging
import math
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify import parser as _mv_parser
from sympy import Basic, FiniteSet, Tuple, evaluate, log

from tandem.reward.answer_contract import (
    disagreeing_boxes,
    every_side,
    final_sentence,
    hedge,
    hedge_after,
    several_values,
    stated_after_last_box,
)
from tandem.reward.answer_cost import MAX_CHARS, shape_cost, tree_cost
from tandem.reward.answer_forms import normal_form, plus_minus, unit
from tandem.reward.answer_structure import despace, relation_sides, statement
from tandem.reward.answer_structure import stated as states_answer
from tandem.reward.config import RewardConfig
from tandem.reward.extract import answer_text, box_spans
from tandem.reward.question_forms import (
    asks_percent,
    has_percent,
    letter,
    option_named,
    options,
    percent_as_fraction,
    without_percent,
)
from tandem.reward.time_limit import TimeLimitExpired, time_limit
from tandem.services.protocol import Verdict

# math-verify warns once that its timeouts are off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
# A box holds LaTeX: where LaTeX cannot read all of it, the plain-expression reading would grade
# a number picked out of it (`\\boxed{12 \\lll 13}` read as 13).
_BOXED = [LatexExtractionConfig()]
_SHOWN = 200  # characters of the extracted answer kept in a verdict


class _Costly(Exception):
    """An answer refused by the cost check while it is being parsed (answer_cost.py)."""


# The timer's exception, under the name this module has always raised (a verdict, never an escape).
MathTimeout = TimeLimitExpired


def _gold(answer: str):
    """Parse the reference answer, which data sets give bare (`1/2`), in LaTeX or boxed; a
    reference with ± as its values (`\\frac{-1 \\pm \\sqrt{5}}{2}` is two roots)."""
    text = (plus_minus(answer) or answer).strip()
    if "\\boxed" in text or "$" in text:
        return parse(text, _EXTRACTION, parsing_timeout=None)
    return parse(f"${text}$", _EXTRACTION, parsing_timeout=None) or \
        parse(text, _EXTRACTION, parsing_timeout=None)


def _verdict(ok: bool, cfg: RewardConfig, reason: str, extracted: str | None, **extra) -> Verdict:
    shown = None if extracted is None else extracted[:_SHOWN]
    # Counted per step (reward_hedged, reward_limits_hit): a policy drifting into hedging or
    # pathological answers shows on the report before it shows in the accuracy.
    flags = {"hedged": True} if reason.startswith("hedged") else \
        {"limit": True} if reason.startswith(("too costly", "timeout")) else {}
    return Verdict(reward=cfg.correct_reward if ok else cfg.wrong_reward, correct=ok,
                   details={"task": "math", "reason": reason, "extracted": shown, **flags, **extra})


def grade_math(response: str, answer: str, cfg: RewardConfig | None = None,
               timeout_s: float | None = -1.0, question: str = "") -> Verdict:
    """Grade one response against the reference `answer`.

    The final answer is the content of the last `\\boxed{}` after `</think>`; where the
    reference has several values (roots, a set of pairs) and the answer boxes each one, all the
    boxes. Without a box: wrong when `cfg.math_require_box`, else math-verify's extraction on the
    answer sentence (the last sentence naming the answer, else the last sentence), and failing
    that on the whole answer text. A hedged or pathological answer is wrong before any symbolic
    work on it (answer_contract.py). `details.source` names which rule found the answer.
    With the `question`, an option letter and its value answer alike, and where a percent is
    asked a bare decimal does not pass for it (question_forms.py). Forms math-verify misreads
    are rewritten first for both (answer_forms.py); a relation is graded on every side, a unit
    both state must be the same, and floats agree to six significant digits, not six decimals.
    `timeout_s` -1 means cfg.math_timeout_s, None means no in-process limit.
    """
    cfg = cfg or RewardConfig()
    if timeout_s is not None and timeout_s < 0:
        timeout_s = cfg.math_timeout_s
    text = answer_text(response)
    if text is None:
        return _verdict(False, cfg, "no answer: <think> block never closed", None)
    spans = box_spans(text)
    found = [(start, _unwrapped(content)) for start, _, content in spans]
    boxed = found[-1][1] if found else None     # the last box (extract.last_boxed)
    if boxed is None and cfg.math_require_box:
        return _verdict(False, cfg, "no \\boxed{} answer", None, source="none")
    # "... \\boxed{255} for the first half ... The final answer is 10,455.": the sentence answers.
    stated = None if boxed is None or cfg.math_require_box else stated_after_last_box(text, spans[-1][1] + 1)
    if stated:
        boxed, final, source = None, stated, "the answer sentence after the last box"
    elif boxed is not None:
        final, source = boxed, "boxed"
    else:
        final, source = final_sentence(text), "fallback: the answer sentence"
    answer, final, boxed, read = _read_with_question(question, answer, final, boxed)
    # The answer contract (answer_contract.py), part one: a bounded cost, checked before any
    # symbolic work on the answer (the reference is trusted data).
    why = shape_cost(final) or next((w for _, b in found if (w := shape_cost(b))), None)
    if why:
        return _verdict(False, cfg, why, final, source=source)
    try:
        with time_limit(timeout_s):
            gold = _gold(answer)
            if not gold:
                return _verdict(False, cfg, f"reference answer {answer[:100]!r} is not parsable", None)
            # Part two: one final answer where the reference is one value.
            several = several_values(answer) or _several(gold)
            why = hedge(final, several, prose=boxed is None) or _hedge_around(text, spans, found, boxed, final, several)
            if why:
                return _verdict(False, cfg, why, final, source=source)
            pred, source = _prediction(text, boxed, final, found, several, source)
            source += read
            if not pred:
                return _verdict(False, cfg, "no parsable answer", final, source=source)
            # (The cost check on the parsed tree ran in _parse_answer.)
            extracted = str(pred[-1])
            rounding = _float_rounding(gold)
            # An inequality answers an interval (math-verify's set-relation comparison), and
            # alternatives joined by "or" their union; only where the reference has several
            # values, so `x = 5` stays an answer to 5 as before.
            ok = _agree(gold, pred, rounding) or (several and (
                verify(gold, _relations_or(pred, final), allow_set_relation_comp=True, timeout_seconds=None)
                or _agree(gold, _as_union(final), rounding)))
            if not ok and (decimal := _decimal_comma(answer)):
                # `1,22`: the values 1 and 22 in an English data set, 1.22 in a European one
                # (math-verify's only reading). Either is accepted; the answer is one number.
                ok = verify(decimal, pred, timeout_seconds=None)
                source += "; the reference read with a decimal comma" if ok else ""
            # Part three, where the answer is read strictly: a relation is graded on every side
            # (math-verify reads one: `12 \\approx 13` as 12, `x = 12 \\vee x = 13` as 13), and
            # a unit, where both state one, is the reference's (math-verify drops both).
            if not several and (boxed is not None or states_answer(final)):
                chain = final if boxed is not None else statement(final)
                why = every_side(relation_sides(chain), _is_name, lambda side, near: _side_is(gold, side, near, rounding))
                if why:
                    return _verdict(False, cfg, why, final, source=source)
            if ok and (units := (unit(answer), unit(final)))[0] and units[1] and units[0] != units[1]:
                return _verdict(False, cfg, f"wrong unit: {units[1]} where the reference has {units[0]}", final,
                                source=source)
    except _Costly as why:
        return _verdict(False, cfg, str(why), final, source=source)
    except MathTimeout:
        return _verdict(False, cfg, f"timeout: grading took over {timeout_s:g}s", final)
    except RecursionError:
        return _verdict(False, cfg, "answer too deeply nested to parse", final)
    return _verdict(ok, cfg, "correct" if ok else "wrong answer", extracted, source=source)


_DECIMAL_COMMA = re.compile(r"\s*\$?\s*(-?\d+),(\d{1,2})\s*\$?\s*")


# Numbers, brackets, relations and the four operations (with \frac and \sqrt) cannot write a
# number longer than the answer: no tree to check. Anything else is checked, however written.
_PLAIN = re.compile(r"(?:[\d\s.,+\-/()\[\]{}%$<>=|:;]|\\(?:[dt]?frac|sqrt|pi|cdot|times|div|infty|left|right"
                    r"|[%$,;:! ])(?![A-Za-z])|\\text\s*\{[^{}\\]*\})*")


def _parse_answer(text: str, content: str | None = None, configs: list = _EXTRACTION) -> list:
    """The answer parsed for verify, once its parsed tree is known to cost little.

    It is parsed first with sympy's evaluation off: that parse builds the tree and computes
    nothing (`\\binom{1000000}{500000}` is computed while parsing otherwise), and
    answer_cost.tree_cost reads it. Only then is it parsed as math-verify always parses it,
    so what verify compares is unchanged. The parser's cache is emptied in between, so no
    later parse gets the unevaluated tree. A plain answer (`content`, else `text`: digits and
    the four operations) is parsed once."""
    if not _PLAIN.fullmatch(text if content is None else content):
        try:
            with evaluate(False):
                tree = parse(text, configs, parsing_timeout=None)
        finally:
            _mv_parser.parse_latex_cached.cache_clear()
        why = tree_cost(tree)
        if why:
            raise _Costly(why)
    return parse(text, configs, parsing_timeout=None)


def _hedge_around(text: str, spans: list, found: list, boxed: str | None, final: str, several: bool) -> str | None:
    """Why what surrounds the answer makes it a hedge: boxes that disagree, or another value on
    the line after the answer (the box, else the answer sentence)."""
    if boxed is not None:
        return disagreeing_boxes(text, found, several) or hedge_after(text, spans[-1][1] + 1, boxed, several)
    at = text.rfind(final)      # (an option letter read as its value is not in the text)
    return hedge_after(text, at + len(final), final, several, boxed=False) if at >= 0 else None


def _float_rounding(gold: list) -> int:
    """Decimals to which math-verify rounds floats before comparing: its 6, or as many as six
    significant digits of the reference take (1/3,000,000 rounded to 6 decimals is 0, which
    `0.0` then matched, issue 61)."""
    scales = []
    for g in gold[:1]:
        for x in (g.args if isinstance(g, (FiniteSet, Tuple)) else [g]) if isinstance(g, Basic) else []:
            if getattr(x, "is_number", False) and x.is_finite and not x.is_zero:
                size = abs(x.evalf(15))
                if size.is_comparable and 0 < size < 1:
                    scales.append(math.floor(float(log(size, 10))))
    return min(max(6, 5 - min(scales, default=0)), 60)


def _agree(gold: list, pred: list, rounding: int) -> bool:
    return bool(pred) and bool(verify(gold, pred, float_rounding=rounding, timeout_seconds=None))


_ALTERNATIVES = re.compile(r"\\lor(?![A-Za-z])|\\vee(?![A-Za-z])|∨|\\text\s*\{\s*or\s*\}|\bor\b")


def _as_union(final: str) -> list:
    """Sets joined by "or" (`(-\\infty,-1) \\lor (1,\\infty)`) as their union, or []."""
    if not _ALTERNATIVES.search(final):
        return []
    union = despace(_ALTERNATIVES.sub(r" \\cup ", final), commas=False)
    return _parse_answer(f"\\boxed{{{union}}}", union, _BOXED)


def _is_name(side: str) -> bool:
    """Whether one side of a relation names what the answer is about (`x`, `f(2)`, `a_5`,
    `\\angle A`) rather than stating a value: it parses to something with a free symbol or an
    undefined function. A side that does not parse is not a name."""
    from sympy.core.function import AppliedUndef
    parsed = [p for p in _parse_answer(f"${side}$", None, _BOXED) if isinstance(p, Basic)]
    if not parsed:        # P(X = 2), Pr(A \\mid B): a function of what LaTeX cannot read alone
        return _CALLED.fullmatch(side) is not None
    return bool(parsed[0].free_symbols or parsed[0].atoms(AppliedUndef))


_CALLED = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*\(.*\)\s*", re.DOTALL)


def _side_is(gold: list, side: str, approximate: bool, rounding: int) -> bool:
    """Whether one side of a relation is the reference; beside `\\approx`, a decimal side also
    when it is the reference rounded to its decimals (`\\sqrt{2} \\approx 1.414`)."""
    parsed = _parse_answer(f"${side}$", None, _BOXED)
    if _agree(gold, parsed, rounding):
        return True
    written = _DECIMAL.fullmatch(side.strip())
    if not (approximate and written and isinstance(gold[0], Basic) and gold[0].is_number):
        return False
    try:
        return abs(complex(gold[0].evalf(30)) - float(written.group(0))) <= 0.5 * 10.0 ** -len(written.group(1))
    except (TypeError, ValueError):
        return False


_DECIMAL = re.compile(r"-?\d+\.(\d+)")


_BOX_ONLY = re.compile(r"\\(?:boxed|fbox)\{(.*)\}", re.DOTALL)


def _unwrapped(content: str) -> str:
    """`\\boxed{\\boxed{12}}` is a box of 12 (any other box inside a box is read as part of the
    content, where it offers a second value). Only within MAX_CHARS: a longer content is refused
    by its length, and unwrapping 12,000 nested boxes one scan each would be quadratic."""
    while len(content) <= MAX_CHARS and (inner := _BOX_ONLY.fullmatch(content)) \
            and box_spans(content)[0][2] == inner.group(1).strip():
        content = inner.group(1).strip()
    return content


def _decimal_comma(answer: str) -> list | None:
    """The reference `1,22` as the number 1.22 (one comma, one or two digits after it, no
    space: `1,000` is a thousand and `1, 22` a list either way)."""
    got = _DECIMAL_COMMA.fullmatch(answer)
    return parse(f"${got.group(1)}.{got.group(2)}$", _EXTRACTION, parsing_timeout=None) if got else None


def _read_with_question(question: str, answer: str, final: str, boxed: str | None
                        ) -> tuple[str, str, str | None, str]:
    """The reference and the answer as the question frames them, both options read as their
    values (question_forms.py), in the forms math-verify reads (answer_forms.py), and what was
    read that way (for `details.source`)."""
    notes = []
    listed = options(question) if question else {}
    said = final if boxed is not None else statement(final)    # "The answer is (B)." says (B)
    if named := option_named(said, listed):
        final = listed[named]
        notes.append(f"the answer's option ({named}) by its value")
    elif (wanted := letter(answer)) and (mine := letter(said)):
        answer, final = wanted, mine if boxed is not None else f"${mine}$"
        notes.append("an option letter")
    if wanted := option_named(answer, listed):
        answer = listed[wanted]
        notes.append(f"the reference's option ({wanted}) by its value")
    asked = bool(question) and asks_percent(question)
    if asked and not has_percent(final) and has_percent(answer):
        answer = without_percent(answer)
        notes.append("a percent asked for (the reference's number, not its fraction)")
    elif asked and has_percent(final) and not has_percent(answer):
        final = without_percent(final)
        notes.append("a percent asked for (the answer's number)")
    elif question and not has_percent(question) and not has_percent(answer) and has_percent(final):
        final = percent_as_fraction(final)
        notes.append("no percent asked for (a percent is its fraction)")
    answer, final = normal_form(answer), normal_form(final)
    return answer, final, final if boxed is not None else None, "".join(f"; {n}" for n in notes)


def _several(gold) -> bool:
    """Whether the parsed reference holds several values: a set of more than one, an interval
    or union, a relation (`1 <= |z| <= 3/2`)."""
    from sympy import FiniteSet, Set
    from sympy.logic.boolalg import Boolean
    return any((isinstance(g, Set) and not (isinstance(g, FiniteSet) and len(g) == 1)) or isinstance(g, Boolean)
               for g in gold if not isinstance(g, str))


_NUMBER_AND_UNIT = re.compile(r"\s*\\(?:text|textbf|mathrm)\s*\{\s*(-?\d+(?:\.\d+)?)\s*[A-Za-z][A-Za-z .]*\}\s*")
_OR = re.compile(r"\bor\b|\\lor|\\vee")


def _relations_or(pred: list, final: str) -> list:
    """`x < -1 or x > 1` as the union of its solution sets, so it meets an interval reference
    (math-verify reads the alternatives as a set of relations, which equals no interval)."""
    from sympy import FiniteSet, Union
    from sympy.core.relational import Relational
    head = pred[0] if pred else None
    if not (isinstance(head, FiniteSet) and _OR.search(final) and all(isinstance(r, Relational) for r in head)
            and len(set().union(*(r.free_symbols for r in head))) == 1):
        return pred
    return [Union(*(r.as_set() for r in head)), *pred[1:]]


def _prediction(text: str, boxed: str | None, final: str, found: list, several: bool,
                source: str) -> tuple[list, str]:
    """The parsed answer and the rule that found it (`details.source`; `source` names the
    sentence an unboxed `final` is)."""
    if boxed is not None and several and len(found) > 1:
        # math-verify's own handling of several boxes: together they are the answer's set.
        # Each box's tree is checked alone (math-verify cannot order a set of unevaluated
        # tuples); the parse of all of them then evaluates only what was checked.
        for _, box in found:
            plain = despace(normal_form(box), commas=False)
            _parse_answer(f"\\boxed{{{plain}}}", plain)
        return parse(text, _EXTRACTION, parsing_timeout=None), "boxes: every box (the reference has several values)"
    if boxed is not None:
        boxed = despace(boxed, commas=False)     # 1\\,000 is 1000 (math-verify reads 1 \\cdot 000)
        unit = _NUMBER_AND_UNIT.fullmatch(boxed)
        if unit:   # \\text{5 cm}: math-verify reads the whole text as a word
            return _parse_answer(f"\\boxed{{{unit.group(1)}}}", unit.group(1)), \
                "boxed: a number and its unit in one \\text{}"
        if several and (both := plus_minus(boxed)):    # \\frac{-1 \\pm \\sqrt{5}}{2}: its two values
            return _parse_answer(f"\\boxed{{{both}}}", both, _BOXED), "boxed: each sign of \\pm"
        pred = _parse_answer(f"\\boxed{{{boxed}}}", boxed, _BOXED)
        if not _valued(pred) and "\\" not in boxed:   # plain text such as 2**3 in a box
            pred = _parse_answer(f"\\boxed{{{boxed}}}", boxed)
        return pred, "boxed"
    pred = _parse_answer(despace(final, commas=False))
    if pred:
        return pred, source
    return _parse_answer(_tail(text)), "fallback: math-verify's extraction of the answer text"


def _tail(text: str) -> str:
    """The end of the answer text, where its answer is, for math-verify's own extraction: that
    extraction is quadratic on degenerate text (25 KB of `\\(` cost seconds), so it reads at
    most MAX_CHARS characters, from a word's start."""
    if len(text) <= MAX_CHARS:
        return text
    tail = text[-MAX_CHARS:]
    space = tail.find(" ")
    return tail[space + 1:] if 0 <= space < 100 else tail


def _valued(pred: list) -> bool:
    return any(not isinstance(p, str) for p in pred)
