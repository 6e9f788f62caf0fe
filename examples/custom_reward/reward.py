"""An example reward function: the final answer checked against the row's `answer`, a bonus for
stating it in `\\boxed{}` and a penalty for rambling past a length budget.

    tandem run configs/math-tiny.yaml reward.function=examples.custom_reward.reward:score

`score(prompt, response, row)` is what `reward.function` calls, in the reward service's grader
workers, once per sampled response: `prompt` is the problem's text, `response` the model's
decoded answer, `row` the data set's row (here `answer` and `id`). It returns a map: `reward`
(a number within [reward.wrong_reward, reward.correct_reward]: here [-1, 1], as
configs/math-tiny.yaml sets them), `correct` (what accuracy counts) and any details worth
keeping (they reach the verdict as `details.user`).

The response is written by the policy being trained: whatever this function gives the most
reward for, the policy will learn to write. So the answer is found with Tandem's linear-time
helpers (reward/extract.py: a response of a million `\\boxed{` costs one scan), only the text
after the thinking counts, and the comparison is exact — no partial credit a hedge could earn.
"""
from __future__ import annotations

import re

from tandem.reward.extract import answer_text, last_boxed

CORRECT, WRONG = 0.8, -0.8
BOX_BONUS = 0.2          # the answer stated as \boxed{...}, right or wrong
LENGTH_BUDGET = 2000     # characters; past it the penalty grows to LENGTH_PENALTY at twice this
LENGTH_PENALTY = 0.2
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_NOISE = re.compile(r"\\[,;:! ]|\$|\s|\\text\{\s*\}|\.$")


def _normal(text: str) -> str:
    """`$1{,}000.$` -> `1000`: spacing, dollars, thousands separators and a final period dropped."""
    text = _NOISE.sub("", text.strip()).replace("{,}", "").rstrip(".")
    return text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text) else text


def same_answer(given: str, reference: str) -> bool:
    a, b = _normal(given), _normal(reference)
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


def final_answer(response: str) -> tuple[str | None, bool]:
    """(the final answer, whether it was boxed): the last box after the thinking, else the last
    number there; (None, False) when the thinking never ended."""
    text = answer_text(response)
    if text is None:
        return None, False
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    numbers = _NUMBER.findall(text[-500:])
    return (numbers[-1] if numbers else None), False


def score(prompt: str, response: str, row: dict) -> dict:
    final, boxed = final_answer(response)
    correct = final is not None and same_answer(final, str(row["answer"]))
    reward = (CORRECT if correct else WRONG) + (BOX_BONUS if boxed else 0.0)
    overlong = max(0, len(response) - LENGTH_BUDGET) / LENGTH_BUDGET
    reward -= LENGTH_PENALTY * min(1.0, overlong)
    return {"reward": round(reward, 6), "correct": correct, "extracted": None if final is None else final[:100],
            "boxed": boxed, "reason": "right answer" if correct else "no answer" if final is None else "wrong answer"}
