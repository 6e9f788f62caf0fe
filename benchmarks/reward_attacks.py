"""The cost of each answer-side attack of issues 32 and 61 in one grader process: program
extraction and box finding on hostile responses, and math grading of huge numbers written every
way the issues found, of answers slow without a big number (sums, products, expansions, matrix
operations, math-verify's own extraction on degenerate text) and of hedged answers. The goal
(issue 61): none costs more than 1 s beyond a trivial answer (`\\boxed{2}` for 2), so none
comes near the math timeout (`reward.math_timeout_s`); each row says how many trivial answers
it costs.

Each row is the slowest of `reps` runs (the first run of each includes sympy's warm-up, so
the warm-up is done once before timing). Tests assert the same attacks by the work done
(tests/unit/reward/test_answer_cost.py, test_linear_extraction.py); this times them, on a
machine shared with other work: read the ratios, not the milliseconds.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import time

from benchmarks.common import cli, print_table, write_results
from tandem.reward.config import RewardConfig
from tandem.reward.extract import boxes, extract_program
from tandem.reward.math_grader import grade_math

_MATRIX_7 = r"\begin{pmatrix}" + r"\\".join("&".join(f"a_{{{i}{j}}}" for j in range(7)) for i in range(7)) \
    + r"\end{pmatrix}"
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
    # issue 61
    r"\boxed{\prod_{k=1}^{1000} k^k}": "1",
    r"\boxed{\prod_{k=1}^{100} k^{1000-k}}": "1",
    r"\boxed{\sum_{k=1}^{1000} 2^k}": "1",
    r"\boxed{\sum_{i=1}^{1000}\sum_{j=1}^{1000} i j}": "1",
    r"\boxed{\prod_{i=1}^{100}\prod_{j=1}^{100} (i+j)}": "1",
    r"\boxed{\det" + _MATRIX_7 + "}": "1",
    r"\boxed{" + _MATRIX_7.replace("pmatrix", "vmatrix") + "}": "1",
    r"\boxed{(x+1)^{50}(x+2)^{50}(x+3)^{50}(x+4)^{50}}": "1",
    r"\boxed{(x+y+z+1)^{40}}": "1",
    r"\boxed{\int_0^1 e^{x^2}\sin(x^3)\, dx}": "1",
    "\\(" * 12_500 + "\nDone.": "1",                # math-verify's extraction of the whole text
    "1 " * 12_500 + "\nDone.": "1",
    r"\boxed{12 \approx 13}": "12",
    r"\boxed{x = 12 \vee x = 13}": "13",
    r"\boxed{(x+y+z+1)^{7}}": "1",                     # expansions within the limit (120, 126 terms)
    r"\boxed{(a+b+c+d+e)^{5}}": "1",
    r"\boxed{\sum_{k=1}^{100} k^{k}}": "1",           # the most terms a sum may have
}
TRIVIAL = (r"\boxed{2}", "2")
GOAL_S = 1.0     # beyond the trivial answer


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
    trivial_ms = slowest_ms(grade_math, (*TRIVIAL, cfg), reps)
    limit_ms = trivial_ms + GOAL_S * 1e3
    rows, worst = [], 0.0
    for name, (fn, text) in EXTRACTION.items():
        ms = slowest_ms(fn, text, reps)
        rows.append([name, ms, round(ms / trivial_ms, 1), "-", ms <= limit_ms])
        worst = max(worst, ms)
    for response, gold in MATH.items():
        verdict = grade_math(response, gold, cfg)
        ms = slowest_ms(grade_math, (response, gold, cfg), reps)
        shown = response if len(response) < 60 else response[:24] + f"... ({len(response)} chars)"
        rows.append([shown, ms, round(ms / trivial_ms, 1), verdict.details["reason"][:48], ms <= limit_ms])
        worst = max(worst, ms)
    print_table(f"answer-side attacks: slowest of {reps} runs; a trivial answer {trivial_ms:.2f} ms, goal "
                f"{GOAL_S:g} s beyond it", ["attack", "ms", "x trivial", "verdict", "within the goal"], rows)
    headline = {"attacks": len(rows), "slowest_attack_ms": round(worst, 2), "trivial_ms": round(trivial_ms, 2),
                "slowest_over_trivial": round(worst / trivial_ms, 1), "all_within_goal": all(r[-1] for r in rows),
                "goal_s_beyond_trivial": GOAL_S}
    if not quick:
        write_results("reward_attacks", headline)
    return headline


if __name__ == "__main__":
    cli(main)
