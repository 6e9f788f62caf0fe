"""`tandem reward grade --task math|code --input IN.jsonl --output OUT.jsonl`: grading files.

Rows are `{id, response, answer}` (math) or `{id, response, tests}` (code, APPS/TACO
`input_output` convention). Each output row is its input row plus `reward`, `correct` and
`details`, in input order. Invalid rows are reported by line and id on stderr and left out; the
rest are still graded (exit status 1 tells a script that some rows were invalid). Grading goes
through the same worker pool as the service, so time limits and crash isolation are the same.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tandem.reward.config import RewardConfig
from tandem.reward.pool import GraderPool
from tandem.services.protocol import GradeItem, code_tests_problem

BATCH = 64  # rows handed to the pool at once (bounds memory, keeps every worker busy)


def row_problem(task: str, row) -> str | None:
    """What makes a row ungradable, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if "id" not in row:
        return "missing 'id'"
    if not isinstance(row.get("response"), str):
        return "'response' must be a string" if "response" in row else "missing 'response'"
    if task == "math":
        if "answer" not in row:
            return "missing 'answer'"
        if not isinstance(row["answer"], (str, int, float)) or isinstance(row["answer"], bool):
            return f"'answer' must be a string or a number, got {type(row['answer']).__name__}"
        return None
    tests = row.get("tests")
    if isinstance(tests, str):  # TACO stores input_output as a JSON string
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            return f"'tests' is a string but not JSON: {e}"
        row["tests"] = tests
    if tests is None:
        return "missing 'tests'"
    return code_tests_problem(tests)


def read_rows(task: str, path: Path) -> tuple[list[dict], list[str]]:
    """(valid rows, problems as 'line N (id X): why')."""
    rows, problems = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            why = row_problem(task, row)
            if why:
                rid = row.get("id", "?") if isinstance(row, dict) else "?"
                problems.append(f"line {n} (id {rid!r}): {why}")
                continue
            rows.append(row)
    return rows, problems


def _item(task: str, row: dict, with_row: bool = False) -> GradeItem:
    # With a user's reward function (reward.function / url) the input row, less the response,
    # is the row it receives; the built-in graders need only the fields below.
    rest = {k: v for k, v in row.items() if k != "response"} if with_row else None
    question = str(next((row[k] for k in ("question", "problem", "prompt") if row.get(k)), ""))
    if task == "math":
        return GradeItem(task="math", response=row["response"], answer=str(row["answer"]), question=question, row=rest)
    return GradeItem(task="code", response=row["response"], tests=row["tests"], question=question, row=rest)


async def _grade_all(task: str, rows: list[dict], cfg: RewardConfig, out, progress) -> dict:
    pool = GraderPool(cfg)
    await pool.start()
    counts = {"graded": 0, "correct": 0, "errors": 0}
    # Long enough that only a broken grader, never a slow batch, hits it.
    deadline = BATCH * max(pool.hard_limit_s(task), 1.0)
    try:
        for start in range(0, len(rows), BATCH):
            batch = rows[start:start + BATCH]
            verdicts = await pool.grade([_item(task, r, bool(cfg.function or cfg.url)) for r in batch], deadline)
            for row, v in zip(batch, verdicts, strict=True):
                out.write(json.dumps({**row, "reward": v.reward, "correct": v.correct,
                                      "details": v.details}) + "\n")
                counts["graded"] += 1
                counts["correct"] += v.correct
                counts["errors"] += "error" in v.details
            out.flush()
            progress(counts["graded"], len(rows))
    finally:
        await pool.close()
    return counts


def grade_file(task: str, input_path: Path, output_path: Path, cfg: RewardConfig,
               quiet: bool = False) -> int:
    if task not in ("math", "code"):
        print(f"tandem reward grade: --task must be math or code, got {task!r}", file=sys.stderr)
        return 2
    if not input_path.exists():
        print(f"tandem reward grade: input file {input_path} does not exist", file=sys.stderr)
        return 2
    rows, problems = read_rows(task, input_path)
    for p in problems:
        print(f"{input_path}: invalid row, {p}", file=sys.stderr)

    def progress(done, total):
        if not quiet:
            print(f"graded {done}/{total}", file=sys.stderr, flush=True)

    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "w", encoding="utf-8") as out:
        counts = asyncio.run(_grade_all(task, rows, cfg, out, progress)) if rows else \
            {"graded": 0, "correct": 0, "errors": 0}
    accuracy = counts["correct"] / counts["graded"] if counts["graded"] else 0.0
    print(f"{output_path}: {counts['graded']} graded, {counts['correct']} correct ({accuracy:.1%}), "
          f"{counts['errors']} grader errors, {len(problems)} invalid rows skipped")
    return 1 if problems else 0
