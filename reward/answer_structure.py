"""How many values an answer offers, read from its structure (the answer contract's hedges).

A list of separator words is always one spelling short (issue 32: `\\vee`, `∨`, `\\mid`, a
line break, "OR", "12 and 13" all passed a list that had `or`, `,` and `\\lor`), and it reads
LaTeX's spaces `\\,` `\\;` as list commas. So the answer is read as a structure instead:

- **Spacing is never a separator**: `\\,` `\\;` `\\:` `\\!` `\\ ` `~` `\\quad` ... are spaces, and
  digit groups written with them or with commas (`1\\,000`, `1{,}000`, `1,000`) are one number.
- **Values are joined by operators**: `+ - * / ^ = <` `\\cdot` `\\frac{..}{..}` ... make one
  expression of their operands (`3\\sqrt{2}`, `5\\text{ cm}^2`, `x = 12`). Anything else
  between two numbers — a word ("or", "and", "OR"), a comma, a line break `\\\\`, or any symbol
  that is not an operator (`\\vee`, `∨`, `\\mid`, `|`) — leaves them two values. The operators
  are listed; the separators are not, so a new spelling of "or" is a separator by default.
- **Lists in brackets** (`(1, 3)`, `\\{12, 13\\}`, not a call's arguments `f(1, 2)`), `\\pm`,
  a union, an answer by cases (`\\begin{cases}`) offer several values; a matrix is one value.
- **Text** (`\\text{...}`) is prose: `\\text{5 cm}` is one value, `\\text{12 or 13}` two.
- **Prose**: a stated answer ("the answer is 12, as required") offers what follows it, each
  distinct value counted: a trailing clause with no other value is still one answer. An
  answer sentence that states nothing is working ("3 + 4 = 7, then 7 is prime"): there only
  values with nothing but punctuation or "or" between them are alternatives.
Two parts that share a side (`12` and `3 \\cdot 4 = 12`) are one value.
"""
from __future__ import annotations

import re
from decimal import Decimal

SPACING = re.compile(r"\\\\|\\[,;:! ]|\\(?:q?quad|enspace|thinspace|medspace|thickspace|negthinspace)(?![A-Za-z])"
                     r"|\\hspace\*?\s*\{[^{}]*\}|~")     # a line break is matched whole: its second backslash and a space are no `\ `
_SIZING = re.compile(r"\\(?:left|right|[bB]igg?[lr]?|displaystyle|textstyle)(?![A-Za-z])\s*\.?")
_GROUPS = re.compile(r"(?<=\d)(?:\{,\}|,\\!\s*|,|\\[,;: ]|~| )(?=\d{3}(?!\d))")  # 1,000 1{,}000 11,\! 111 1\,000 1 000
_SPACED_GROUPS = re.compile(r"(?<=\d)(?:\{,\}|,\\!\s*|\\[,;: ]|~)(?=\d{3}(?!\d))")   # 1\,000 11,\! 111 (no bare comma)
_TOKEN = re.compile(r"""
  (?P<num>\d+(?:\.\d+|,\d{1,2}(?!\d))?|\.\d+)          # 1000,99: a decimal comma
| \\begin\s*\{(?P<begin>[A-Za-z*]+)\}
| (?P<end>\\end\s*\{[A-Za-z*]+\})
| (?P<text>\\(?:text|textbf|textit|textrm|texttt|textsf|mbox|emph)\s*\{)
| (?P<box>\\(?:boxed|fbox)\s*\{)
| (?P<open>\\\{|\\langle(?![A-Za-z])|[(\[{])
| (?P<close>\\\}|\\rangle(?![A-Za-z])|[)\]}])
| (?P<cmd>\\[A-Za-z]+\*?|\\.)
| (?P<word>[A-Za-z]+)
| (?P<space>\s+)
| (?P<other>.)
""", re.X | re.S)
_OPERATORS = set("+-*/^_!':") | set("−×÷·")
_RELATIONS = set("=<>") | set("≤≥≠≈")
_OPERATOR_COMMANDS = {"cdot", "times", "div", "ast", "star", "bmod", "mod", "pmod", "cap", "setminus",
                      "frac", "dfrac", "tfrac", "cfrac", "sqrt", "binom", "dbinom", "tbinom", "sum", "prod",
                      "int", "lim", "to", "rightarrow", "in", "notin", "subset", "subseteq", "supset",
                      "supseteq", "neg", "lnot"}
_RELATION_COMMANDS = {"le", "leq", "ge", "geq", "ne", "neq", "lt", "gt", "approx", "equiv", "sim", "simeq",
                      "cong", "leqslant", "geqslant", "implies", "iff", "Rightarrow", "Leftrightarrow"}
_SEVERAL_COMMANDS = {"pm": "±", "mp": "∓", "cup": "a union"}
_MATRICES = {"matrix", "pmatrix", "bmatrix", "Bmatrix", "vmatrix", "Vmatrix", "smallmatrix", "array"}
_CALLER = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)$")      # f(1, 2), \gcd(4, 6): arguments, not a list
_STATED = re.compile(r"\banswer\s*(?:is|:|=)\s*", re.IGNORECASE)
# What chains values: relations, arrows and logical connectives (a side of each is a value).
_CHAIN = re.compile(r"(?<![<>!=:\\])=(?!=)|==|[<>≤≥≠≈∼≃≅≡→⇒⇔↔←⇐⟹⟶⟵↦∨∧]"
                    r"|\\(?:approx|sim|simeq|cong|equiv|doteq|propto|neq?|leq?|geq?|lt|gt|leqslant|geqslant|ll|gg"
                    r"|to|gets|mapsto|implies|impliedby|iff|vee|lor|wedge|land|leadsto"
                    r"|(?:[lL]ong)?(?:left|right|leftright|Left|Right|Leftright)arrow)(?![A-Za-z])")
# Prose is English: two values are alternatives when only punctuation and these stand between them.
ALTERNATION = frozenset({"or", "either", "nor", "maybe", "possibly", "perhaps", "probably", "alternatively",
                         "otherwise", "also", "and"})
_ALTERNATION_IN_WORKING = frozenset({"or", "either"})     # "3 and 4 is 7" is working, not a list
_MAX_LEVELS = 60


def despace(text: str, commas: bool = True) -> str:
    """`text` with LaTeX spacing as plain spaces, sizing commands (`\\left(`) dropped and digit
    groups joined (`1\\,000` is 1000): what is read. Without `commas` only groups set apart by
    spacing are joined: what math-verify is given (it reads `1,000` itself, and `(12,102)` is
    an interval)."""
    text = (_GROUPS if commas else _SPACED_GROUPS).sub("", text)
    return SPACING.sub(_space, _SIZING.sub("", text))


def _space(m: re.Match) -> str:
    return m.group(0) if m.group(0) == "\\\\" else " "


def stated(sentence: str) -> bool:
    """Whether an answer sentence states its answer ("The final answer is 42")."""
    return _STATED.search(sentence) is not None


def relation_sides(text: str) -> list[tuple[str, str]]:
    """The sides of a chain of relations at the top level of `text` (outside every bracket),
    each with the relation or connective just before it ("" for the first): `x = 12 \\approx
    13` is x, = 12, \\approx 13; `x = 12 \\vee x = 13` is x, = 12, \\vee x, = 13. One side
    where there is no relation."""
    depth, cuts = 0, []
    marks = {m.start(): m for m in _CHAIN.finditer(text)}
    for i, c in enumerate(text):
        if i in marks and depth == 0:
            cuts.append(marks[i])
        depth += c in "{([" and (i == 0 or text[i - 1] != "\\")
        depth -= c in "})]" and (i == 0 or text[i - 1] != "\\") and depth > 0
    sides, start, before = [], 0, ""
    for m in cuts:
        sides.append((before, text[start:m.start()].strip()))
        start, before = m.end(), m.group(0).strip()
    sides.append((before, text[start:].strip()))
    return [(r, side) for r, side in sides if side]


def statement(sentence: str) -> str:
    """What an answer sentence states ("**Answer: (B)**" states `(B)`); the whole sentence
    where it states nothing in so many words."""
    return _STATED.split(sentence)[-1].strip(" *_$.")


def offered(answer: str, prose: bool = False, joiners: frozenset[str] | None = None) -> str | None:
    """Why `answer` (a box's content, or with `prose` an answer sentence) offers several values,
    or None when it offers at most one. In a box every distinct value counts; in prose a
    number joined to another by punctuation or `joiners` (ALTERNATION after "answer is", only
    "or" in working) — see the module's docstring."""
    text = despace(answer)
    if prose:
        parts = _STATED.split(text)
        if joiners is None:
            joiners = ALTERNATION if len(parts) > 1 else _ALTERNATION_IN_WORKING
        text = parts[-1]
    reader = _Reader(_TOKEN.finditer(text), prose)
    try:
        level = reader.level(closed=False, depth=0)
    except _Several as why:
        return str(why)
    except _TooDeep:             # only a sentence after a box can get here (shape_cost bounds the rest)
        return None
    return _distinct(level, joiners)


class _Several(Exception):
    """Raised by the reader where a structure offers several values outright (±, cases, a list in
    brackets); its message says which."""


class _TooDeep(Exception):
    """Brackets nested past _MAX_LEVELS: not read further."""


class _Level:
    """The parts of one bracket level: each part a list of sides (`x = 12` has two), with the
    words between it and the part before (prose)."""

    def __init__(self):
        self.parts: list[tuple[list[str], list[str]]] = []
        self.sides: list[str] = [""]
        self.words: list[str] = []
        self.valued = False       # the current part holds an operand
        self.numbered = False     # a number since the last operator: a second one is a new part
        self.script = False       # after _ or ^: the next token is a script (`\\log_2 5`, `x^2 y`)
        self.unit = False         # the part began after a word: `cm^2` continues the unit
        self.listed = False       # a separator (comma, line break) at this level

    def end_part(self, separator: bool = False):
        if self.valued and not self.unit:
            self.parts.append(([s for s in self.sides if s], self.words))
            self.words = []
        self.sides, self.valued, self.numbered, self.unit = [""], False, False, False
        self.listed |= separator

    def operand(self, text: str, number: bool = False):
        if number and self.numbered:
            self.end_part(separator=True)
        if not self.valued and not self.sides[-1]:     # a part of its own, not a unit's `^2`
            self.unit = False
        self.sides[-1] += text
        self.valued = True
        self.numbered |= number and not self.script
        self.script = False


class _Reader:
    def __init__(self, tokens, prose: bool):
        self.tokens = tokens
        self.math = not prose

    def level(self, closed: bool, depth: int) -> _Level:
        """Read tokens up to the one closing this level (`closed`), else to the end."""
        here = _Level()
        for m in self.tokens:
            kind, tok = m.lastgroup, m.group(0)
            if kind == "close" or kind == "end":
                if closed:
                    break
                continue
            if kind == "num":
                here.operand(format(Decimal(tok.replace(",", ".")).normalize(), "f"), number=True)
            elif kind == "space" or tok == ".":
                continue
            elif kind == "word" and not self.math:
                here.end_part()
                here.words.append(tok.lower())
                here.unit = True
            elif kind == "word":
                here.operand(tok)
            elif kind in ("open", "box", "text", "begin"):
                self.group(here, m, depth)
            elif kind == "cmd":
                self.command(here, tok[1:])
            elif tok == "$":
                self.math = not self.math
            elif tok in ",;&" or tok == "\n":
                here.end_part(separator=tok != "&")
            elif tok in _RELATIONS:
                here.sides.append("")
                here.numbered = here.unit = False
            elif tok in _OPERATORS:
                here.sides[-1] += tok
                here.numbered = False
                here.script = tok in "_^"
            elif tok in "±∓∪":
                raise _Several(f"hedged: several values ({tok!r}) for a one-value reference")
            else:                          # |, ∨, ?: not an operator, so numbers on both sides stay apart
                here.operand(tok)
        here.end_part()
        return here

    def command(self, here: _Level, name: str):
        if name in _SEVERAL_COMMANDS:
            raise _Several(f"hedged: several values ({_SEVERAL_COMMANDS[name]}) for a one-value reference")
        if name == "\\":                                     # a line break: a new line, a new part
            here.end_part(separator=True)
        elif name in _RELATION_COMMANDS:
            here.sides.append("")
            here.numbered = here.unit = False
        elif name in _OPERATOR_COMMANDS:
            here.sides[-1] += "\\" + name
            here.numbered = False
        elif name in ("(", ")", "[", "]"):
            self.math = name in "(["
        else:                                                # \pi, \%, \circ, \sin, and \vee, \mid
            here.operand("\\" + name)

    def group(self, here: _Level, m: re.Match, depth: int):
        """A bracket, a brace group, a box, a text or an environment, opened by `m`."""
        kind, tok = m.lastgroup, m.group(0)
        if depth > _MAX_LEVELS:
            raise _TooDeep()
        if kind == "begin":
            env = m.group("begin").rstrip("*")
            if env == "cases":
                raise _Several("hedged: an answer by cases for a one-value reference")
            inner = self.level(closed=True, depth=depth + 1)
            if env in _MATRICES:
                here.operand("\\matrix")
                return
        elif kind == "text":
            was, self.math = self.math, False
            inner = self.level(closed=True, depth=depth + 1)
            self.math = was
            here.end_part()
            here.parts += inner.parts
            here.words += inner.words           # \text{ or } between two numbers
            here.unit = not inner.parts
            return
        else:
            caller = _CALLER.search(here.sides[-1]) is not None and tok == "("
            was = self.math
            self.math |= tok == "{"             # a brace group is LaTeX's, even in bare prose
            inner = self.level(closed=True, depth=depth + 1)
            self.math = was
            if kind == "box":                                  # a box inside: its parts are this level's
                here.end_part()
                here.parts += inner.parts
                return
            if inner.listed and len(inner.parts) > 1 and not caller:
                raise _Several("hedged: a list, set or interval for a one-value reference")
            if tok == "{" and len(inner.parts) > 1:
                raise _Several("hedged: several values in one group for a one-value reference")
            if not self.math and tok != "{":                   # prose: a parenthesis is a part of its own
                here.end_part()
                here.parts += inner.parts
            elif inner.parts:                                  # math: an operand (2(3), \frac{1}{2})
                here.operand("(" + "".join("=".join(sides) for sides, _ in inner.parts) + ")")
            return
        here.end_part()
        here.parts += inner.parts


def _distinct(level: _Level, joiners: frozenset[str] | None) -> str | None:
    """Why the parts of the top level are several values: two parts that name different values
    (in prose: numbers, with nothing but punctuation and `joiners` between them; "the largest
    $n$ is 34" names one number)."""
    seen: list[list[str]] = []
    for sides, words in level.parts:
        if not sides or sides in seen or (joiners is not None and not any(c.isdigit() for s in sides for c in s)):
            continue
        joined = joiners is None or all(w in joiners for w in words)
        if joined and any(not _same(sides, before) for before in seen):
            return f"hedged: several values ({seen[0][-1]!r} and {sides[-1]!r}) for a one-value reference"
        seen.append(sides)
    return None


def _same(a: list[str], b: list[str]) -> bool:
    """Whether two parts name one value: the value of each is its last side (`x = 12` is 12),
    and `3 \\cdot 4 = 12` names 12 too."""
    return a[-1] in b or b[-1] in a
