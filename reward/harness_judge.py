"""How the sandbox judges a test: the comparison rules of each tests convention (stdlib only).

This file is compiled together with `reward/harness.py` and runs inside the sandbox, after every
process of the program is gone (the harness reads the expected outputs only then); the grader
also imports `_as_text` to write each stdin the way the judge reads an expected output.
"""
import math

SNIPPET = 200


def _is_int(token):
    digits = token[1:] if token[:1] in ("+", "-") else token
    return digits.isascii() and digits.isdigit()


def _decimal(token):
    """The token as a float if it is written as a decimal number in ASCII, else None. float()
    alone reads far more: any Unicode digit (fullwidth `７.５`), `1_000.5`, `inf`, `nan`."""
    body = token[1:] if token[:1] == "-" else token
    mantissa, _, exponent = body.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    if not (whole or fraction) or not all(p == "" or (p.isascii() and p.isdigit()) for p in (whole, fraction)):
        return None
    if "e" in body.lower() and not _is_int(exponent):
        return None
    return float(token)


def _tokens_match(got, expected):
    """Token by token. An expected integer must come back as the same text (`7` is not `007`
    nor `+7`; a relative tolerance would pass 123456790 for 123456789, 1e18 for 10**18 + 1);
    only an expected decimal is compared with a tolerance, and only to a decimal written in
    ASCII digits."""
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if _is_int(y):
            return False
        fx, fy = _decimal(x), _decimal(y)
        if fx is None or fy is None or not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def _as_text(v):
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


def _same(a, b):
    """`a` (returned) equals `b` (expected): floats within a tolerance, but only numbers (not
    "0.5" or True for 0.5), and an expected int exactly (3.0 for 3, not 3.0000001)."""
    if isinstance(a, float) or isinstance(b, float):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return False
        if isinstance(b, int):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _lcb_same(a, b):
    """LiveCodeBench's rule for returned values: a tuple counts as a list, then `==`."""
    return (list(a) if isinstance(a, tuple) else a) == b


def _lcb_lines_match(got, expected):
    """LiveCodeBench's rule for stdout: as many lines (each stripped) as expected; a line that
    differs as text must hold the same numbers, token for token, as exact decimals."""
    from decimal import Decimal, InvalidOperation
    a, b = ([line.strip() for line in t.strip().split("\n")] for t in (got, _as_text(expected)))
    if len(a) != len(b):
        return False
    try:
        return all(x == y or [Decimal(t) for t in x.split()] == [Decimal(t) for t in y.split()]
                   for x, y in zip(a, b, strict=True))
    except (InvalidOperation, ValueError):
        return False


def _judge(task, runs, outputs):
    """Each run's answer against its expected output (the program is gone by now)."""
    call = bool(task.get("fn_name"))
    if task.get("convention") == "livecodebench":
        same = _lcb_same if call else _lcb_lines_match
    else:
        same = _same if call else (lambda got, expected: _tokens_match(got, _as_text(expected)))
    results = []
    for run, expected in zip(runs, outputs, strict=True):
        rec = {k: v for k, v in run.items() if k not in ("answer", "stderr")}
        rec["passed"] = False
        if run["status"] == "ok":
            answer = run["answer"]
            rec["passed"] = same(answer, expected)
            rec["status"] = "passed" if rec["passed"] else "wrong output"
        if not rec["passed"]:
            if "answer" in run:
                rec["got"] = (repr(run["answer"]) if call else run["answer"])[:task.get("shown_chars") or SNIPPET]
            rec["expected"] = (repr(expected) if call else _as_text(expected))[:SNIPPET]
            if "stderr" in run:
                rec["stderr"] = run["stderr"]
        results.append(rec)
    return results
