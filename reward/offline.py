"""`tandem reward grade --task math|code --input IN.jsonl --output OUT.jsonl`: grading files.

Rows are `{id, response, answer}` (math) or `{id, response, tests}` (code, APPS/TACO
`input_output` convention). Each output row is its input row plus `reward`, `correct` and
`details`, in input order. Invalid rows are reported by line and id on stderr and left out; the
rest are still graded (exit status 1 tells a script that some rows were invalid). A row that is
valid JSON but cannot be graded (a lone surrogate in a string: no encoder writes it) is written
wrong, with its reason, and costs no other row. Grading goes through the same worker pool as
the service, so time limits and crash isolation are the same.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tandem.reward.config import RewardConfig
from tandem.reward.pool import GraderPool, error_verdict
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
    """(valid rows, problems as 'line N (id X): why'). Each line is read alone, so a line that
    is not UTF-8 or not JSON (nested past the parser's recursion, an integer past Python's
    digit limit) is that line's problem only."""
    rows, problems = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(f"line {n}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            except (ValueError, RecursionError) as e:
                problems.append(f"line {n}: not readable JSON ({type(e).__name__}: {str(e)[:100]})")
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


def not_text(value, where: str = "") -> str | None:
    """Where `value` (a row's field, whatever JSON nests in it) holds a string that is not
    Unicode text — a lone surrogate such as the JSON escape `\\ud800`, which no encoder can
    write, so the row cannot travel to a grader — or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{where or 'a value'} holds a lone surrogate (U+{ord(value[e.start]):04X} at character " \
                   f"{e.start + 1}), not Unicode text"
        return None
    if isinstance(value, dict):
        items = [(f"{where}.{k}" if where else str(k), k, v) for k, v in value.items()]
    else:
        items = [(f"{where}[{i}]", None, v) for i, v in enumerate(value)] if isinstance(value, list) else []
    for path, key, v in items:
        if why := (not_text(key, f"a key of {where or 'the row'}") if key is not None else None) or not_text(v, path):
            return why
    return None


async def _grade_all(task: str, rows: list[dict], cfg: RewardConfig, out, progress) -> dict:
    pool = GraderPool(cfg)
    await pool.start()
    counts = {"graded": 0, "correct": 0, "errors": 0, "ungradable": 0}
    # Long enough that only a broken grader, never a slow batch, hits it.
    deadline = BATCH * max(pool.hard_limit_s(task), 1.0)
    try:
        for start in range(0, len(rows), BATCH):
            batch = rows[start:start + BATCH]
            # A row that cannot be graded costs that row only: it is written wrong, with why.
            items = [_item(task, r, bool(cfg.function or cfg.url)) for r in batch]
            why = [not_text({"response": i.response, "answer": i.answer, "question": i.question, "tests": i.tests,
                             "row": i.row}) for i in items]
            gradable = [i for i, w in zip(items, why, strict=True) if not w]
            verdicts = iter(await pool.grade(gradable, deadline))
            for row, w in zip(batch, why, strict=True):
                v = error_verdict(cfg, task, w) if w else next(verdicts)
                out.write(json.dumps({**row, "reward": v.reward, "correct": v.correct,
                                      "details": v.details}) + "\n")
                counts["graded"] += 1
                counts["correct"] += v.correct
                counts["ungradable"] += bool(w)
                counts["errors"] += "error" in v.details and not w
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
            {"graded": 0, "correct": 0, "errors": 0, "ungradable": 0}
    accuracy = counts["correct"] / counts["graded"] if counts["graded"] else 0.0
    print(f"{output_path}: {counts['graded']} graded, {counts['correct']} correct ({accuracy:.1%}), "
          f"{counts['errors']} grader errors, {counts['ungradable']} not gradable (wrong, with the reason), "
          f"{len(problems)} invalid rows skipped")
    return 1 if problems or counts["ungradable"] else 0
