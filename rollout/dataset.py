"""Prompt data sets: JSONL readers for the formats real runs use, and a resumable shuffled order.

Math rows follow DeepScaleR (`{problem | prompt, answer}`); code rows follow DeepCoder
(`{problem | prompt, tests}`, tests in the APPS/TACO `input_output` convention, possibly as a
JSON string) or LiveCodeBench (`livecodebench.py`, graded by that benchmark's rules). A row
missing a field is reported with its file and line; the loader stops only if no usable row is
left, so one bad line does not sink a 40K-row data set.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from rollout.livecodebench import (
    LiveCodeBenchRowError,
    is_livecodebench_row,
    livecodebench_prompt,
    public_cases,
)
from rollout.synthetic import generate as generate_synthetic
from services.protocol import code_tests_problem

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    pass


@dataclass
class Prompt:
    id: str
    text: str
    task: str
    # math: {"answer": str}; code: {"tests": {...}}
    reference: dict = field(default_factory=dict)


def _row_to_prompt(row: dict, task: str, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if task == "code" and is_livecodebench_row(row):
        try:
            rid, text, tests = livecodebench_prompt(row)
            n_public = len(public_cases(row))
        except LiveCodeBenchRowError as e:
            raise DatasetError(f"{where}: LiveCodeBench row: {e}") from None
        # Its public cases are shown in the problem text: a multi-turn episode's visible tests.
        visible = {**tests, "inputs": tests["inputs"][:n_public], "outputs": tests["outputs"][:n_public]} \
            if n_public else None
        return _code_prompt(rid or where, text, tests, f"{where}: LiveCodeBench row", visible)
    text = row.get("problem", row.get("prompt", row.get("question")))
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(f"{where}: missing 'problem' (or 'prompt') text")
    rid = str(row.get("id", row.get("idx", where)))
    if task == "math":
        answer = row.get("answer", row.get("solution_answer"))
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise DatasetError(f"{where}: math row has no 'answer'")
        return Prompt(rid, text, task, {"answer": str(answer)})
    tests = row.get("tests", row.get("input_output"))
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: 'tests' is a string but not JSON ({e.msg})") from None
    if isinstance(tests, list):  # DeepCoder's list of {input, output} cases
        try:
            tests = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
        except (KeyError, TypeError):
            raise DatasetError(f"{where}: 'tests' list items need 'input' and 'output'") from None
    return _code_prompt(rid, text, tests, f"{where}: code row", row.get("visible_tests"))


def _code_prompt(rid: str, text: str, tests, where: str, visible=None) -> Prompt:
    # The grader's own rule: a row it could not grade would only ever earn the wrong-answer reward.
    problem = code_tests_problem(tests)
    if problem:
        raise DatasetError(f"{where}: {problem}")
    if visible is None:
        return Prompt(rid, text, "code", {"tests": tests})
    # The tests a multi-turn episode runs for feedback (rollout/code_feedback.py).
    problem = code_tests_problem(visible)
    if problem:
        raise DatasetError(f"{where}: visible_tests: {problem}")
    return Prompt(rid, text, "code", {"tests": tests, "visible_tests": visible})


def load_jsonl(path: str | Path, task: str) -> list[Prompt]:
    """All usable prompts of a JSONL file; bad rows are logged with file:line and skipped."""
    path = Path(path)
    if task not in ("math", "code"):
        raise DatasetError(f"unknown task {task!r} (math or code)")
    if not path.exists():
        raise DatasetError(f"{path}: no such data file")
    prompts, bad = [], []
    with open(path, "rb") as f:      # bytes: one line that is not UTF-8 is a bad row, not a bad file
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.append(f"{where}: not UTF-8 (byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                prompts.append(_row_to_prompt(json.loads(line), task, where))
            except json.JSONDecodeError as e:
                bad.append(f"{where}: not JSON ({e.msg})")
            except DatasetError as e:
                bad.append(str(e))
    for msg in bad[:20]:
        log.warning("skipped row: %s", msg)
    if len(bad) > 20:
        log.warning("... and %d more bad rows", len(bad) - 20)
    if bad:
        log.warning("%s: %d usable rows, %d skipped", path, len(prompts), len(bad))
    if not prompts:
        raise DatasetError(f"{path}: no usable rows" + (f" (first problem: {bad[0]})" if bad else ""))
    return prompts


class PromptStream:
    """Endless epochs of a data set in a seeded order; `position` resumes it exactly."""

    def __init__(self, prompts: list[Prompt], seed: int, position: int = 0):
        if not prompts:
            raise DatasetError("empty data set")
        self.prompts, self.seed, self.position = prompts, seed, position
        self._epoch, self._order = -1, []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order

    def next(self) -> Prompt:
        prompt = self.at(self.position)
        self.position += 1
        return prompt

    def at(self, index: int) -> Prompt:
        """The prompt at `index` of the endless seeded order (the same on every call)."""
        epoch, i = divmod(index, len(self.prompts))
        return self.prompts[self._order_for(epoch)[i]]


def load_prompts(dataset: str, task: str, size: int, seed: int) -> list[Prompt]:
    """`synthetic:<task>` or a JSONL file, as Prompts."""
    if dataset.startswith("synthetic:"):
        kind = dataset.split(":", 1)[1]
        rows = generate_synthetic(kind, size, seed)
        if kind == "math":
            return [Prompt(r["id"], r["prompt"], kind, {"answer": r["answer"]}) for r in rows]
        return [Prompt(r["id"], r["problem"], kind, {"tests": r["tests"], "visible_tests": r["visible_tests"]})
                for r in rows]
    return load_jsonl(dataset, task)


def dataset_problem(dataset: str, task: str, rows: int = 100) -> str | None:
    """Why `dataset` cannot feed a run of `task`, or None: checked before a launch (`tandem
    config check`, `tandem run`), so a missing or unreadable file is said in one line instead
    of failing in a rollout worker after the roles started (on SLURM, after the queue). A file
    is opened and read until a usable row, by the rules the workers use (which skip a bad row),
    looking at `rows` non-empty rows at most: a data set with none usable there is refused."""
    if dataset.startswith("synthetic:"):
        kind = dataset.split(":", 1)[1]
        from rollout.synthetic import GENERATORS
        return None if kind in GENERATORS else f"unknown synthetic task {kind!r}; choose from {sorted(GENERATORS)}"
    path = Path(dataset)
    if not path.exists():
        return f"{dataset}: no such file"
    if not path.is_file():
        return f"{dataset}: not a file"
    first, seen = None, 0
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                seen += 1
                try:
                    _row_to_prompt(json.loads(raw.decode("utf-8")), task, f"{dataset}:{lineno}")
                    return None
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    first = first or f"{dataset}:{lineno}: not JSON ({getattr(e, 'msg', None) or e.reason})"
                except DatasetError as e:
                    first = first or str(e)
                if seen >= rows:
                    break
    except OSError as e:
        return f"{dataset}: cannot read it ({e.strerror or e})"
    if not seen:
        return f"{dataset}: holds no rows"
    return f"no usable {task} row in the first {seen}: {first}"
