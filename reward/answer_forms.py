"""Forms of a written answer that math-verify misreads, rewritten to the form it reads.

A human grader reads each of these as one plain value; math-verify alone refuses or misreads them
(issue 61), so a right answer was graded wrong:

- **degrees** `45°`, `45\\degree`, `45\\textdegree`, `45^{°}`: math-verify reads `45^\\circ`;
- **E notation** `1.5e6`, `3E-4`: written out, `1500000`, `0.0003` (math-verify reads `1.5·e·6`,
  the answer contract two values); past `10^{300}` as a power of ten, which the cost check reads;
- **a repeating decimal** `0.\\overline{3}`, `0.1\\overline{6}`, `0.\\dot{3}`, `1.\\bar{09}`: its exact
  fraction;
- **the empty set** `\\varnothing`, `∅`, `\\{\\}`: `\\emptyset` (math-verify reads `\\varnothing` as a
  symbol named varnothing);
- **a full stop** after a number at the very end (`\\boxed{42.}`).

`normal_form` applies them to the reference and to the answer alike. Two more readings are the
grader's to ask for, where they apply: `plus_minus` (an answer `\\frac{-1 \\pm \\sqrt{5}}{2}` as its
two values, where the reference lists them), and `unit` (the unit an answer states, so that
`5\\text{ cm}` does not pass for `5\\text{ m}`: math-verify drops units on both sides).
"""
from __future__ import annotations

import itertools
import re
from decimal import Decimal
from fractions import Fraction

_DEGREES = re.compile(r"\s*(?:\^\s*\{\s*(?:°|\\degree|\\circ)\s*\}|\^\s*(?:°|\\degree)|°|\\degree|\\textdegree"
                      r"|\\text\s*\{\s*°\s*\})(?![A-Za-z])")
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,6})(?![\w.])")
_REPEATING = re.compile(r"(?<![\d.])(\d*)\.(\d{0,50})\\(?:overline|bar|dot)\s*(?:\{\s*(\d{1,50})\s*\}|(\d))")
_EMPTY = re.compile(r"\\varnothing(?![A-Za-z])|∅|(?:\\left)?\\\{(?:\s|\\[ ,;:!])*(?:\\right)?\\\}")
_FULL_STOP = re.compile(r"(?<=\d)\s*\.\s*$")
_PLUS_MINUS = re.compile(r"\\(?:pm|mp)(?![A-Za-z])|±|∓")
MAX_SIGNS = 3              # ± in one answer: 2^3 values at most
MAX_PLAIN_EXPONENT = 300   # 1e300 is written out (301 digits); 1e301 stays a power of ten
# A unit: the letters of a \text{} (or \mathrm{}, \mbox{}) after a number, with a power.
_UNIT = re.compile(r"\\(?:text|textrm|textnormal|mathrm|mbox|operatorname)\s*\{[\s~]*(?:-?\d+(?:\.\d+)?[\s~]*)?"
                   r"([A-Za-z][A-Za-z./ ~^\d-]{0,30}?)\s*\.?\s*\}(\s*\^\s*\{?\s*\d\s*\}?)?")
# In a sentence, a unit is a known one's symbol or name right after the number.
_PROSE_UNIT = re.compile(r"\d\s*([A-Za-z]+(?:/[A-Za-z]+)?)\b\.?\s*$")
_SYMBOLS = {"m", "cm", "mm", "km", "in", "ft", "yd", "mi", "s", "min", "h", "g", "kg", "mg", "L", "mL"}
_UNIT_NAMES = {"meter": "m", "metre": "m", "centimeter": "cm", "centimetre": "cm", "millimeter": "mm",
               "millimetre": "mm", "kilometer": "km", "kilometre": "km", "inch": "in", "inche": "in", "foot": "ft",
               "feet": "ft", "yard": "yd", "mile": "mi", "second": "s", "sec": "s", "minute": "min", "hour": "h",
               "hr": "h", "gram": "g", "kilogram": "kg", "liter": "L", "litre": "L", "milliliter": "mL",
               "millilitre": "mL", "l": "L", "ml": "mL", "degree": "°", "dollar": "$", "cent": "¢"}
_NOT_UNITS = {"or", "and", "if", "is", "so", "the", "a", "an", "answer", "both", "either", "none", "no", "yes"}


def normal_form(text: str) -> str:
    """`text` with the forms above rewritten (an answer or a reference)."""
    text = _DEGREES.sub(r"^\\circ", text)
    text = _E_NOTATION.sub(_plain_number, text)
    text = _REPEATING.sub(_fraction, text)
    text = _EMPTY.sub(r"\\emptyset ", text).strip()
    return _FULL_STOP.sub("", text)


def _plain_number(m: re.Match) -> str:
    """`1.5e6` as `1500000`, `3.3e-7` as `0.00000033` (a decimal math-verify compares to its
    digits); a power of ten past MAX_PLAIN_EXPONENT stays a power (the cost check reads it)."""
    exponent = int(m.group(2))
    if abs(exponent) > MAX_PLAIN_EXPONENT:
        return f"{m.group(1)} \\times 10^{{{exponent}}}"
    return format(Decimal(m.group(0)), "f")


def _fraction(m: re.Match) -> str:
    whole, fixed, repeating = m.group(1) or "0", m.group(2), m.group(3) or m.group(4)
    value = int(whole) + Fraction(int(fixed + repeating) - int(fixed or "0"),
                                  (10 ** len(repeating) - 1) * 10 ** len(fixed))
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def plus_minus(text: str) -> str | None:
    """`a \\pm b` as its values, `a + b, a - b` (each sign of each ±, at most MAX_SIGNS of them),
    or None where `text` has no ±, or is a list or set already (math-verify reads those)."""
    marks = list(_PLUS_MINUS.finditer(text))
    if not marks or len(marks) > MAX_SIGNS or _listed(text):
        return None
    edges = [0, *(x for m in marks for x in (m.start(), m.end())), len(text)]
    pieces = [text[edges[i]:edges[i + 1]] for i in range(0, len(edges), 2)]
    plus_first = [m.group(0) in ("\\pm", "±") for m in marks]
    values = []
    for signs in itertools.product((True, False), repeat=len(marks)):
        out = pieces[0]
        for first, sign, piece in zip(plus_first, signs, pieces[1:], strict=True):
            out += ("+" if sign == first else "-") + piece
        values.append(out.strip())
    return ", ".join(values)


def _listed(text: str) -> bool:
    """Whether `text` is a list or a set at its top level (`1 \\pm \\sqrt{5}, -2`); a comma in a
    subscript (`x_{1,2}`) is not one."""
    depth = 0
    for i, c in enumerate(text):
        if c in "{([" and text[i - 1:i] != "\\":
            depth += 1
        elif c in "})]" and text[i - 1:i] != "\\":
            depth -= 1
        elif depth == 0 and c in ",;":
            return True
    return "\\{" in text or "\\begin" in text


def unit(text: str) -> str | None:
    """The unit an answer states after its number (`5\\text{ cm}`, `5\\,\\mathrm{m}^2`,
    `\\text{5 square meters}`), in one spelling (`meters` is `m`), or None."""
    found = [(m.group(1), m.group(2)) for m in _UNIT.finditer(text) if m.group(1).strip().lower() not in _NOT_UNITS]
    if not found and (bare := _PROSE_UNIT.search(text)) and _spelled(bare.group(1)) in _SYMBOLS | set(_UNIT_NAMES.values()):
        found = [(bare.group(1), None)]
    if not found:
        return None
    words = [_spelled(w) for w in re.split(r"[\s~.]+", found[-1][0]) if w]
    power = re.sub(r"\D", "", found[-1][1] or "")
    if not words:
        return None
    if words[0] in ("square", "cubic") and len(words) > 1:        # square meters: m^2
        power, words = ("2" if words[0] == "square" else "3"), words[1:]
    return " ".join(words) + (f"^{power}" if power and power != "1" else "")


def _spelled(word: str) -> str:
    """One spelling of a unit's word: `meters` is `m`, `Meters` too; a symbol stays as written."""
    if len(word) <= 3:
        return word
    return _UNIT_NAMES.get(word.lower().rstrip("s"), word.lower())
