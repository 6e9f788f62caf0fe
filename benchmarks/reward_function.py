"""The reward hook's yardstick (issue 34): `make train-math` with the built-in math grader, then
the same run with that grader wrapped as a user function (`reward.function=
examples.custom_reward.builtin_math:grade`), one after the other in one process.

Why: the only difference between the two runs is the path a verdict takes — the grader called
by the reward workers, or the user-function hook calling it. Both runs start from the same
warmed-up model, seed and held-out set (greedy, so their "before" is the same figure), so the gap
between their final accuracies is what the hook changes, and its standard error is that of two
independent binomial evaluations. The hook passes when the gap is within 2 s.e.; the wall times
and trajectories/s, measured side by side here, say what the hook costs.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401


from benchmarks.common import cli, print_table, write_results
from benchmarks.train_math import difference_se, run_once

WRAPPED = "reward.function=examples.custom_reward.builtin_math:grade"


def main(quick: bool = False) -> dict:
    builtin = run_once("math", quick, report=None)
    wrapped = run_once("math", quick, extra=(WRAPPED,), report=None)
    keys = ("steps", "wall_s", "accuracy_before", "accuracy_after", "accuracy_gain_points", "trajectories_per_s")
    rows = [[name, *(r[k] for k in keys)] for name, r in (("built-in grader", builtin), ("user function", wrapped))]
    print_table("make train-math: built-in grader vs the same grader as reward.function",
                ["reward", "steps", "wall s", "held-out before", "held-out after", "gain (points)", "trajectories/s"],
                rows)
    n = builtin["eval_n"]
    a, b = builtin["accuracy_after"], wrapped["accuracy_after"]
    gap_se = difference_se(a, n, b, wrapped["eval_n"])
    gap = b - a
    headline = {
        "builtin": builtin, "wrapped": wrapped, "wrapped_override": WRAPPED,
        "after_gap_points": round(100 * gap, 1),
        "after_gap_se_points": round(100 * gap_se, 1) if gap_se else None,
        "after_gap_in_se": round(gap / gap_se, 2) if gap_se else None,
        "within_2_se": bool(gap_se) and abs(gap) <= 2 * gap_se,
        "wall_ratio_wrapped_to_builtin": round(wrapped["wall_s"] / builtin["wall_s"], 3),
        "throughput_ratio_wrapped_to_builtin": round(wrapped["trajectories_per_s"] / builtin["trajectories_per_s"], 3),
    }
    print(f"after RL, user function minus built-in: {headline['after_gap_points']} points "
          f"(± {headline['after_gap_se_points']} s.e., {headline['after_gap_in_se']} s.e.); "
          f"wall time ×{headline['wall_ratio_wrapped_to_builtin']}, "
          f"trajectories/s ×{headline['throughput_ratio_wrapped_to_builtin']}")
    if not quick:
        write_results("reward_function", headline)
    return headline


if __name__ == "__main__":
    cli(main)
