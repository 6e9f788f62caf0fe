"""Every response of Tandem's math corpus (tests/reward/math_corpus.jsonl) gets the verdict a
careful human grader gives it. The corpus is shaped like reasoning-model output: `<think>`
blocks, several boxes, answers stated in prose after an intermediate box, hedges, retractions,
units, percentages, intervals written as inequalities, chatter after the answer, and, with the
problem's text, option letters and percents asked for; plain math-verify's misses are counted
by `python -m benchmarks math_agreement`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math

CORPUS = Path(__file__).resolve().parents[2] / "reward" / "math_corpus.jsonl"
ROWS = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_the_grader_agrees_with_the_human_label(row):
    verdict = grade_math(row["response"], row["answer"], RewardConfig(), question=row.get("question", ""))
    assert verdict.correct == row["correct"], (row["note"], verdict.details)


def test_the_corpus_covers_what_reasoning_models_write():
    categories = {r["category"] for r in ROWS}
    assert {"boxed", "sentence_after_box", "several_boxes", "hedge", "interval", "units", "percent",
            "no_box", "trailing", "pathological", "options"} <= categories
    assert all(any(r["category"] == c and r["correct"] is False for r in ROWS)
               for c in categories - {"percent", "trailing"})   # wrong answers too, not only right ones
