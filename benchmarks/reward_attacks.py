"""The cost of each answer-side attack of issue 32 in one grader process: program extraction
and box finding on hostile responses, and math grading of huge numbers written every way the
issue found and of hedged answers. The goal: none costs more than its limit (the math timeout,
`reward.math_timeout_s`) plus 100 ms; the answer contract refuses most within milliseconds.

Each row is the slowest of `reps` runs (the first run of each includes sympy's warm-up, so
the warm-up is done once before timing). Tests assert the same attacks by the work done
(tests/unit/reward/test_answer_cost.py, test_linear_extraction.py); this times them.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import time

from benchmarks.common import cli, print_table, write_results
from tandem.reward.config import RewardConfig
from tandem.reward.extract import boxes, extract_program
from tandem.reward.math_grader import grade_math

EXTRACTION = {
    "``` then 100 KB with no newline (program extraction)": (extract_program, "```" + "a" * 100_000),
    "12,000 unclosed \\boxed{ (box finding)": (boxes, r"\boxed{" * 12_000),
    "12,000 nested \\boxed{ (box finding)": (boxes, r"\boxed{" * 12_000 + "1" + "}" * 12_000),
}
MATH = {   # response -> reference
    r"\boxed{9^{9^{9^{9}}}}": "1",
    r"\boxed{9^{(9^9)}}": "1",
    r"\boxed{9^{9^{9}+0}}": "1",
    "The answer is 9**9**9.": "1",
    r"\boxed{10^{10}!}": "1",
    r"\boxed{\binom{10^{6}}{5 \cdot 10^{5}}}": "1",
    r"\boxed{\binom{1000000}{500000}}": "1",
    r"\boxed{\Gamma(1000001)}": "1",
    r"\boxed{\sqrt{2}^{10^{9}}}": "1",
    r"\boxed{(1+10^{-9})^{10^{9}}}": "1",
    r"\boxed{\prod_{k=1}^{1000000} k}": "1",
    r"\boxed{" * 12_000: "1",
    r"\boxed{" * 12_000 + "1" + "}" * 12_000: "1",
    r"\boxed{12}, " + "k = 1, " * 20_000: "12",      # a long line after the box
    r"\boxed{12 \vee 13}": "12",
    r"\boxed{12}, or possibly 13": "12",
    r"\boxed{12 = 13}": "12",
}


def slowest_ms(fn, arg, reps: int) -> float:
    args = arg if isinstance(arg, tuple) else (arg,)
    worst = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        worst = max(worst, time.perf_counter() - t0)
    return worst * 1e3


def main(quick: bool = False) -> dict:
    reps = 1 if quick else 5
    cfg = RewardConfig()
    grade_math(r"\boxed{2^{10}}", "1024", cfg)          # sympy's and math-verify's warm-up
    limit_ms = cfg.math_timeout_s * 1e3 + 100
    rows, worst = [], 0.0
    for name, (fn, text) in EXTRACTION.items():
        ms = slowest_ms(fn, text, reps)
        rows.append([name, ms, "-", ms <= 100])
        worst = max(worst, ms)
    for response, gold in MATH.items():
        verdict = grade_math(response, gold, cfg)
        ms = slowest_ms(grade_math, (response, gold, cfg), reps)
        shown = response if len(response) < 60 else response[:24] + f"... ({len(response)} chars)"
        rows.append([shown, ms, verdict.details["reason"][:48], ms <= limit_ms])
        worst = max(worst, ms)
    print_table(f"answer-side attacks: slowest of {reps} runs, limit {limit_ms:.0f} ms",
                ["attack", "ms", "verdict", "within limit + 100 ms"], rows)
    headline = {"attacks": len(rows), "slowest_attack_ms": round(worst, 2),
                "all_within_limit": all(r[-1] for r in rows), "limit_ms": limit_ms}
    if not quick:
        write_results("reward_attacks", headline)
    return headline


if __name__ == "__main__":
    cli(main)
