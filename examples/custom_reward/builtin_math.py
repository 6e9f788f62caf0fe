"""Tandem's own math grader as a user reward function: the same verdicts through the user hook.

    make train-math ARGS="reward.function=examples.custom_reward.builtin_math:grade"

Why it exists: it is the yardstick of the hook. A run with it must learn as a run with the
built-in grader does (issue 34: the same gain within 2 standard errors), since the only
difference is the path — a user function in the grader workers instead of the grader itself.

It returns `correct` without `reward`, so the item earns the experiment's own correct_reward or
wrong_reward, whatever they are set to. It grades with the grader's default settings
(reward.math_require_box: false, a 5 s time limit inside the function's own
reward.function_timeout_s); the built-in path reads them from the experiment.
"""
from __future__ import annotations

from tandem.reward.math_grader import grade_math


def grade(prompt: str, response: str, row: dict) -> dict:
    verdict = grade_math(response, str(row["answer"]), question=prompt)
    return {"correct": verdict.correct, **verdict.details}
