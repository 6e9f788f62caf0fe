"""Math grading agreement with human labels: Tandem's grader beside plain math-verify, on
math-verify's own regression cases and on Tandem's corpus of reasoning-model responses.

A wrong reward is a silent training bug, and Tandem's math grader wraps math-verify: it must
never be worse than the library on the library's own labelled cases. Those cases ship in
math-verify's source distribution (its `tests/`: parametrized `(gold, prediction, expected)`
triples, labelled by its authors). This benchmark downloads that sdist once from PyPI for the
installed version (`.cache/math-verify-sdist/`), reads the triples with `ast` (the test files
are never imported or run) and grades each prediction twice: plain math-verify with its
default settings (`verify(parse(gold), parse(prediction))`) and `grade_math(prediction, gold)`.
Cases whose test function sets other options (precision, strictness, set relations) are left
out: their labels assume those options. It reports how often each agrees with the label, and
lists the cases where one agrees and the other does not.

The second set is `tests/reward/math_corpus.jsonl`: responses shaped like a reasoning model's
(a `<think>` block, several boxes, answers in prose, hedges, units, intervals, chatter after the
answer, option letters and percents asked for, graded with the problem's text), each labelled with what a careful human grader would say.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import ast
import json
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

from math_verify import parse, verify

from benchmarks.common import cli, print_table, write_results
from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "reward" / "math_corpus.jsonl"
CACHE = ROOT / ".cache" / "math-verify-sdist"
FIELDS = (("gold", "pred", "expected"), ("gold", "pred", "result"))


def sdist_tests() -> Path:
    """math-verify's `tests/` folder of the installed version, downloaded once."""
    release = version("math-verify")
    tests = CACHE / f"math_verify-{release}" / "tests"
    if tests.is_dir():
        return tests
    CACHE.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          f"math-verify=={release}", "-d", str(CACHE), "-q"], capture_output=True, text=True,
                         timeout=300, check=False)
    if got.returncode != 0:
        raise SystemExit(f"cannot download math-verify {release}'s source distribution from PyPI "
                         f"(its labelled cases live there): {got.stderr.strip()[-300:]}")
    with tarfile.open(CACHE / f"math_verify-{release}.tar.gz") as tar:
        tar.extractall(CACHE, filter="data")
    return tests


def labelled_cases(tests: Path) -> list[tuple[str, str, str, bool, str]]:
    """(where, gold, prediction, expected, question) of every 3-field parametrized case (none has a question)."""
    out = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize"):
                continue
            names = tuple(n.strip() for n in ast.literal_eval(node.args[0]).split(","))
            if names not in FIELDS:
                continue
            for i, element in enumerate(getattr(node.args[1], "elts", [])):
                try:
                    gold, pred, expected = ast.literal_eval(element)
                except ValueError:
                    continue  # built by code (an f-string), not a literal: left out
                out.append((f"{path.name}:{node.lineno}#{i}", gold, pred, bool(expected), ""))
    return out


def corpus_cases() -> list[tuple[str, str, str, bool, str]]:
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    return [(r["id"], r["answer"], r["response"], r["correct"], r.get("question", "")) for r in rows]


def plain_math_verify(gold: str, pred: str) -> bool:
    try:
        return bool(verify(parse(gold), parse(pred)))
    except Exception:  # noqa: BLE001 - a crash is a wrong verdict, as in a reward
        return False


def agreement(cases: list[tuple[str, str, str, bool, str]]) -> dict:
    cfg = RewardConfig()
    agree = {"plain": 0, "tandem": 0}
    only = {"plain": [], "tandem": []}
    for where, gold, pred, expected, question in cases:
        plain = plain_math_verify(gold, pred)
        verdict = grade_math(pred, gold, cfg, question=question)
        agree["plain"] += plain == expected
        agree["tandem"] += verdict.correct == expected
        if (plain == expected) != (verdict.correct == expected):
            only["plain" if plain == expected else "tandem"].append(
                {"where": where, "gold": gold, "pred": pred[-300:], "expected": expected,
                 "tandem_reason": verdict.details.get("reason"), "tandem_source": verdict.details.get("source")})
    return {"cases": len(cases), **agree, "only_plain_right": only["plain"], "only_tandem_right": only["tandem"]}


def main(quick: bool = False) -> dict:
    sets = {"math-verify's own cases": labelled_cases(sdist_tests()), "Tandem's reasoning-model corpus": corpus_cases()}
    if quick:
        sets = {name: cases[:10] for name, cases in sets.items()}
    results = {name: agreement(cases) for name, cases in sets.items()}
    rows = []
    for name, r in results.items():
        rows += [[name, "plain math-verify (defaults)", r["plain"], r["cases"], r["plain"] / r["cases"]],
                 [name, "Tandem's grader", r["tandem"], r["cases"], r["tandem"] / r["cases"]]]
    print_table("agreement with human labels", ["cases", "grader", "agree", "n", "agreement"], rows)
    for name, r in results.items():
        for c in r["only_plain_right"]:
            print(f"{name}: only math-verify right: {c['where']}: gold {c['gold']!r} pred {c['pred'][-80:]!r} "
                  f"expected {c['expected']}: {c['tandem_reason']}")
    own, corpus = results["math-verify's own cases"], results["Tandem's reasoning-model corpus"]
    headline = {"own_cases": own["cases"], "own_agreement_plain": round(own["plain"] / own["cases"], 4),
                "own_agreement_tandem": round(own["tandem"] / own["cases"], 4),
                "corpus_cases": corpus["cases"], "corpus_agreement_plain": round(corpus["plain"] / corpus["cases"], 4),
                "corpus_agreement_tandem": round(corpus["tandem"] / corpus["cases"], 4),
                "disagreements": results}
    if not quick:
        write_results("math_agreement", headline)
    return headline


if __name__ == "__main__":
    cli(main)
