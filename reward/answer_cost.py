"""The cost of grading an answer, bounded before any symbolic work on it (the answer contract).

`\\boxed{9^{9^{9^{9}}}}` held a grader worker for its whole timeout (issue 22), and so did the
same tower written another way — `9^{(9^9)}`, `9^{9^{9}+0}`, `9**9**9`, `10^{10}!`,
`\\binom{10^{6}}{5 \\cdot 10^{5}}` (issue 32): a check that reads the text for the shapes its
authors thought of misses every other spelling. So the check reads what the verifier would
compute, in two steps:

1. **The text** (`shape_cost`), before parsing, since the parser itself recurses and backtracks:
   its length and its bracket nesting; and what the parser computes while reading (an operation
   on a matrix: a 7x7 symbolic determinant took over the timeout before any tree existed).
2. **The parsed tree** (`tree_cost`): the answer is parsed with sympy's evaluation off (the
   parse builds the expression, computes nothing), then one walk over the tree estimates, for
   every numeric node, the value and the digits its exact evaluation would have — a power
   `b^e` has about `|e| · digits(b)` digits whatever wrote `e`, a factorial `n!` about
   `log10 Γ(n+1)`, a binomial, a product or sum with numeric bounds likewise. Any node over
   the bound makes the answer wrong (reason `too costly: ...`) before anything is evaluated.
   The walk visits each node once and does float arithmetic only (overflow is infinity), so
   its cost is linear in the tree, and the tree in the answer's length.

What is slow without a big number in sight is read from the tree too (issue 61): a sum or
product's terms (nested ones multiplied) and its terms' size at the variables' largest magnitude,
the terms an expression expands to (`(x+y+z+1)^{40}`, which issue 32 left to the timeout),
integrals of what is not a polynomial. The per-answer timeout stays as the backstop.
"""
from __future__ import annotations

import math
import re

from sympy import (
    Abs,
    Add,
    Basic,
    Float,
    Integral,
    Mul,
    NumberSymbol,
    Pow,
    Product,
    Rational,
    Sum,
    UnevaluatedExpr,
    binomial,
    exp,
    factorial,
    factorial2,
    ff,
    gamma,
    log,
    rf,
    subfactorial,
)
from sympy.core.numbers import ImaginaryUnit
from sympy.matrices import MatrixBase

MAX_CHARS = 1000          # an answer longer than this is not a final answer
MAX_DEPTH = 30            # brackets nested deeper than this
MAX_DIGITS = 10_000       # a number this long (a power or factorial) is not computed
MAX_SYMBOLIC_EXPONENT = 50     # (x+1)^{999} takes seconds to compare, (x+1)^{100} half of one
MAX_TERMS = 100           # terms of a sum or product with numeric bounds, nested ones multiplied
# (sympy sums up to 100 terms one by one, and tries symbolic summation past that: `\\sum_{k=1}^{1000}
# 2^k` took 4 s, `\\sum_{k=1}^{300} k^k` over 5)
MAX_EXPANSION = 150       # terms of an expression expanded: (x+y+z+1)^{8} has 165, 0.4-0.9 s to compare
MAX_NODES = 20_000        # nodes of the parsed tree walked (a 1000-character answer has far fewer)
MAX_MATRIX_ENTRIES = 16   # entries of a matrix something is done to (4x4: a determinant of 24 terms)
_MATRIX = re.compile(r"\\begin\s*\{((?:[pbBvV]|small)?matrix|array)\}(.*?)\\end\s*\{\1\}", re.DOTALL)

_LOG10_2 = math.log10(2)
_FACTORIALS = (factorial, factorial2, subfactorial)


class TooCostly(Exception):
    """Raised inside the walk with the reason; the walk stops at the first costly node."""


def shape_cost(answer: str) -> str | None:
    """Why parsing `answer` could be costly (its length, its nesting), or None."""
    if len(answer) > MAX_CHARS:
        return f"too costly: an answer of {len(answer)} characters (limit {MAX_CHARS})"
    depth = deepest = 0
    for c in answer:
        depth += c in "{(["
        depth -= c in "})]"
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        return f"too costly: brackets nested {deepest} deep (limit {MAX_DEPTH})"
    return _matrix_cost(answer)


def _matrix_cost(answer: str) -> str | None:
    """Why the parser itself would compute for seconds: it evaluates what is done to a matrix as
    it reads it (a determinant `\\det`, `vmatrix`; `\\operatorname{rank}`, eigenvalues, powers,
    products), before any tree exists to check: a 7x7 symbolic determinant took over 5 s. So a
    matrix that is not the whole answer may have at most MAX_MATRIX_ENTRIES entries."""
    matrices = list(_MATRIX.finditer(answer))
    if not matrices:
        return None
    alone = len(matrices) == 1 and matrices[0].group(1) not in ("vmatrix", "Vmatrix") \
        and not (answer[:matrices[0].start()] + answer[matrices[0].end():]).strip(" $")
    biggest = max(m.group(2).count("&") + len(re.findall(r"\\\\(?!\s*$)", m.group(2).strip())) + 1
                  for m in matrices)
    if alone or biggest <= MAX_MATRIX_ENTRIES:
        return None
    return f"too costly: an operation on a matrix of {biggest} entries (limit {MAX_MATRIX_ENTRIES})"


def tree_cost(parsed) -> str | None:
    """Why evaluating the parsed answer (math-verify's list of sympy objects and strings,
    parsed with evaluation off) could take more than milliseconds, or None."""
    walk = _Walk()
    try:
        for item in parsed:
            walk.estimate(item)
    except TooCostly as why:
        return f"too costly: {why}"
    except RecursionError:
        return "too costly: a tree too deep to walk"
    except (ArithmeticError, ValueError, TypeError) as e:   # refused: the walk stopped before the end
        return f"too costly: an answer the cost check cannot read ({type(e).__name__})"
    return None


class _Walk:
    """One post-order pass; per node (value, digits): a float near the node's value (None when
    not a number, inf past float range) and the digits of its exact value; and the terms of its
    full expansion. Within a sum or product (`bound`: its variables at their largest magnitude)
    values are magnitudes, so that `k^{1000-k}` is bounded by `1000^{2000}`, not read at one k."""

    def __init__(self, bound: dict | None = None, scale: float = 1.0, nodes: int = 0):
        self.seen: dict[int, tuple[float | None, float]] = {}
        self.terms: dict[int, float] = {}       # terms of the node's expansion (1: no free symbol)
        self.bound, self.scale, self.nodes = bound or {}, scale, nodes

    def estimate(self, root) -> tuple[float | None, float]:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in self.seen:
                continue
            children = _children(node)
            if not ready and children:
                stack.append((node, True))
                stack.extend((c, False) for c in children if id(c) not in self.seen)
                continue
            self.nodes += 1
            if self.nodes > MAX_NODES:
                raise TooCostly(f"an answer of over {MAX_NODES} parts")
            self.seen[id(node)] = self._node(node, [self.seen[id(c)] for c in children])
            self.terms[id(node)] = _expansion(node, [self.terms[id(c)] for c in children], self.seen, self.bound)
            if self.terms[id(node)] > MAX_EXPANSION:
                raise TooCostly(f"an expression of about {self.terms[id(node)]:.3g} terms expanded "
                                f"(limit {MAX_EXPANSION})")
        return self.seen[id(root)]

    def _node(self, node, args: list[tuple[float | None, float]]) -> tuple[float | None, float]:
        if not isinstance(node, Basic):
            return None, max((d for _, d in args), default=0.0)
        if node in self.bound:          # a sum's or product's variable, at its largest magnitude
            return self.bound[node], _digits(int(self.bound[node]))
        if node.is_Atom:
            return _atom(node)
        values = [v for v, _ in args]
        digits = [d for _, d in args]
        known = all(v is not None for v in values)
        if self.bound and known:
            values = [abs(v) for v in values]
        if isinstance(node, Pow):
            return _power(args[0], (values[1], digits[1]))
        if isinstance(node, exp):
            return _power((math.e, 1.0), args[0])
        if isinstance(node, Integral) and not node.function.is_polynomial(*node.variables):
            raise TooCostly("an integral of what is not a polynomial (integrating takes seconds)")
        if isinstance(node, Add):
            return (_finite(lambda: math.fsum(values)) if known else None), sum(digits)
        if isinstance(node, Mul):
            return (_finite(lambda: math.prod(values)) if known else None), sum(digits)
        if isinstance(node, _FACTORIALS) or isinstance(node, gamma):
            return _factorial(values[0], shift=1 if isinstance(node, gamma) else 0, digits=digits[0])
        if isinstance(node, binomial):
            return _binomial(values[0], values[1], sum(digits))
        if isinstance(node, (rf, ff)):
            return _rising(values[0], values[1], sum(digits))
        if isinstance(node, (Sum, Product)):
            return _series(node, args, self)
        if isinstance(node, (Abs, UnevaluatedExpr)):
            return (None if values[0] is None else abs(values[0])), digits[0]
        if isinstance(node, log) and known and values[0]:
            return math.log(abs(values[0])) if math.isfinite(values[0]) else math.inf, digits[0]
        return None, max(digits, default=0.0)


def _children(node) -> list:
    if isinstance(node, MatrixBase):
        return list(node)
    if isinstance(node, (list, tuple)):
        return list(node)
    if isinstance(node, Basic):
        return list(node.args)
    return []


def _atom(node) -> tuple[float | None, float]:
    if isinstance(node, Rational):       # Integer too: q == 1
        return _finite(lambda: node.p / node.q), _digits(node.p) + _digits(node.q)
    if isinstance(node, Float):          # its size is its magnitude: float arithmetic is cheap
        _, man, expo, bits = node._mpf_
        return _finite(lambda: float(node)), abs(expo + bits) * _LOG10_2 if man else 0.0
    if isinstance(node, NumberSymbol):
        return float(node), 1.0
    if isinstance(node, ImaginaryUnit):
        return 1.0, 1.0
    return None, 0.0          # a symbol, infinity, a string


def _digits(n: int) -> float:
    """log10 |n| (0 for 0 and ±1): what an exact power of n grows by per unit of exponent."""
    n = abs(n)
    return math.log10(n) if 0 < n < 1 << 1000 else n.bit_length() * _LOG10_2


def _power(base: tuple[float | None, float], exponent: tuple[float | None, float]) -> tuple[float | None, float]:
    (b, b_digits), (e, e_digits) = base, exponent
    if e is None:                     # 2^x: nothing is computed
        return None, b_digits + e_digits
    size = abs(e) if not math.isnan(e) else math.inf
    if b is None:                     # (x+1)^{100000}: expansion costs what the exponent is
        if size > MAX_SYMBOLIC_EXPONENT:
            raise TooCostly(f"a power with exponent {size:.3g} of a symbolic base (limit {MAX_SYMBOLIC_EXPONENT})")
        return None, b_digits * max(size, 1.0)
    if b_digits == 0.0 and b in (0.0, 1.0, -1.0):     # 1^{huge} is 1: nothing to compute
        return b, 0.0
    # digits grow by the base's per unit of exponent: its exact size (a rational's numerator and
    # denominator), or the size of its value (sqrt 2, pi: sympy may turn them exact)
    per_power = max(b_digits, abs(math.log10(abs(b))) if b and math.isfinite(b) else math.inf)
    digits = size * per_power if per_power else 0.0
    if digits > MAX_DIGITS:
        raise TooCostly(f"a power with about {digits:.3g} digits (limit {MAX_DIGITS})")
    return _finite(lambda: abs(b) ** e), digits


def _symbolic_count(k: float, what: str) -> None:
    """binomial(x, k) and rf(x, k) expand into k factors, like (x+1)^k."""
    if not abs(k) <= MAX_SYMBOLIC_EXPONENT:
        raise TooCostly(f"{what} of {abs(k):.3g} factors (limit {MAX_SYMBOLIC_EXPONENT})")


def _factorial(n: float | None, shift: int, digits: float) -> tuple[float | None, float]:
    if n is None:
        return None, digits
    size = max(abs(n) - shift, 0.0)       # Γ(0), (-1)!: no value, nothing to compute
    out = math.lgamma(size + 1) / math.log(10) if size < 1e300 else math.inf
    if out > MAX_DIGITS:
        raise TooCostly(f"a factorial with about {out:.3g} digits (limit {MAX_DIGITS})")
    return _finite(lambda: math.gamma(size + 1)), max(out, 1.0)


def _binomial(n: float | None, k: float | None, digits: float) -> tuple[float | None, float]:
    if n is None and k is not None:
        _symbolic_count(k, "a binomial coefficient of a symbolic number")
    if n is None or k is None:
        return None, digits
    n, k = abs(n), abs(k)
    if not (math.isfinite(n) and math.isfinite(k)):
        raise TooCostly("a binomial coefficient of unbounded size")
    k = min(k, max(n - k, 0.0))
    out = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(10)
    if out > MAX_DIGITS:
        raise TooCostly(f"a binomial coefficient with about {out:.3g} digits (limit {MAX_DIGITS})")
    return _finite(lambda: 10 ** out), max(out, 1.0)


def _rising(x: float | None, k: float | None, digits: float) -> tuple[float | None, float]:
    if x is None and k is not None:
        _symbolic_count(k, "a rising or falling factorial of a symbolic number")
    if x is None or k is None:
        return None, digits
    out = abs(k) * math.log10(abs(x) + abs(k) + 1) if math.isfinite(k) and math.isfinite(x) else math.inf
    if out > MAX_DIGITS:
        raise TooCostly(f"a rising or falling factorial with about {out:.3g} digits (limit {MAX_DIGITS})")
    return _finite(lambda: 10 ** out), max(out, 1.0)


def _series(node, args: list[tuple[float | None, float]], walk: _Walk) -> tuple[float | None, float]:
    """A sum or product with numeric bounds is computed term by term: at most MAX_TERMS terms,
    counting those of every sum it is nested in (`walk.scale`). Each term is bounded by walking
    the body once with the variables at their largest magnitude: a product of T terms has at
    most T times a term's digits (`\\prod_{k=1}^{1000} k^k`: 3·10^6), a sum that many plus
    log10 T. The bounds were walked already (each limit is a child of the node), so estimating
    them again is a lookup. With a symbolic bound nothing is computed term by term."""
    terms, bound = 1.0, {}
    for limit in node.limits:
        (lo, _), (hi, _) = walk.estimate(limit[1]), walk.estimate(limit[-1])
        if lo is None or hi is None:
            return None, max((d for _, d in args), default=0.0)
        terms *= max(hi - lo + 1, 0.0) if math.isfinite(hi - lo) else math.inf
        bound[limit[0]] = max(abs(lo), abs(hi))
    total = terms * walk.scale
    if not total <= MAX_TERMS:
        raise TooCostly(f"a sum or product of {total:.3g} terms (limit {MAX_TERMS})")
    inner = _Walk({**walk.bound, **bound}, total, walk.nodes)
    _, per_term = inner.estimate(node.function)
    walk.nodes = inner.nodes
    digits = per_term * max(terms, 1.0) if isinstance(node, Product) else per_term + math.log10(max(terms, 1.0))
    if digits > MAX_DIGITS:
        raise TooCostly(f"a sum or product with about {digits:.3g} digits (limit {MAX_DIGITS})")
    return None, digits


def _expansion(node, kids: list[float], seen: dict, bound: dict) -> float:
    """Terms of the node's full expansion, an upper bound: what sympy's comparison may expand
    (`(x+y+z+1)^{40}`: 12,341 terms, seconds; four factors `(x+k)^{50}` multiplied term by term,
    51^4). A sum adds its parts' terms, a product multiplies them, a power of n of k terms has
    C(n+k-1, k-1); a part without a free symbol is one term (a number)."""
    if not isinstance(node, Basic) or node.is_Number or node in bound:
        return 1.0
    if node.is_Symbol:
        return 1.0
    if isinstance(node, Add):
        return math.fsum(kids)
    if isinstance(node, Mul):
        return _finite(lambda: math.prod(kids))
    if isinstance(node, Pow) and kids[0] > 1:
        n, k = seen[id(node.args[1])][0], kids[0]
        if n is None or not math.isfinite(n):
            return k
        n = abs(n)
        return _finite(lambda: math.exp(math.lgamma(n + k) - math.lgamma(n + 1) - math.lgamma(k)))
    return max(kids, default=1.0)


def _finite(value) -> float:
    """value() as a float, inf where it overflows (a complex power counts by its size)."""
    try:
        out = value()
    except (OverflowError, ZeroDivisionError, ValueError):
        return math.inf
    if isinstance(out, complex):
        out = abs(out)
    return out if not math.isnan(out) else math.inf
