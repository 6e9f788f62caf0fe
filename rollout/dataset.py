"""Prompt data sets: rows of JSONL, Parquet or `datasets` directories (data_files.py) as Prompts,
through the config's column mapping, and a resumable shuffled order.

Math rows follow DeepScaleR (`{problem | prompt | question, answer}`); code rows follow DeepCoder
(`{problem | prompt | question, tests}`, tests in the APPS/TACO `input_output` convention,
possibly as a JSON string) or LiveCodeBench (`livecodebench.py`, graded by that benchmark's
rules). `rollout.columns` names other columns for these fields (`{prompt: question, answer:
final_answer}`): a mapped field is read from its column only, in every format. A row missing a
field is reported with its file and line (or row); the loader stops only if no usable row is
left, so one bad line does not sink a 40K-row data set.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field

from tandem.rollout.config import DEFAULT_COLUMNS
from tandem.rollout.data_files import DataFileError, open_data
from tandem.rollout.livecodebench import (
    LiveCodeBenchRowError,
    is_livecodebench_row,
    livecodebench_prompt,
    public_cases,
)
from tandem.rollout.prompt_template import messages as template_messages
from tandem.rollout.synthetic import generate as generate_synthetic
from tandem.services.protocol import code_tests_problem

log = logging.getLogger(__name__)


# A problem longer than this is no prompt a model can take (a 128K-token context holds about half
# as many characters): such a row is skipped, not tokenized (two 20 MB rows once held a worker's
# event loop until its leases expired, and took it to 4.3 GiB).
MAX_PROBLEM_CHARS = 1_000_000


class DatasetError(ValueError):
    pass


@dataclass
class Prompt:
    id: str
    # The problem as the data set has it: what is graded against and told apart from others.
    text: str
    task: str
    # math: {"answer": str}; code: {"tests": {...}}
    reference: dict = field(default_factory=dict)
    # How it is asked (rollout.system_prompt, rollout.prompt_template; prompt_template.py).
    system: str = ""
    template: str = ""
    # The row's other columns (not read into `text` or `reference`), as JSON-like values: what a
    # user's reward function (reward.function) sees of the data set beside the reference.
    row: dict = field(default_factory=dict)

    def messages(self) -> list[dict]:
        """The chat messages that ask this problem: what every episode and evaluation renders."""
        return template_messages(self.text, self.system, self.template)


def _field(row: dict, columns: dict, name: str):
    """(value, the column it was read from): the mapped column only, else the first default there."""
    if name in columns:
        return row.get(columns[name]), columns[name]
    col = next((c for c in DEFAULT_COLUMNS[name] if c in row), DEFAULT_COLUMNS[name][0])
    return row.get(col), col


# The columns a LiveCodeBench row's text and tests are built from (livecodebench.py).
LIVECODEBENCH_COLUMNS = ("question_content", "public_test_cases", "private_test_cases", "metadata", "starter_code")


def _plain(value):
    """A JSON-like copy of a value a columnar format gave (a date, a decimal: as text)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _rest(row: dict, used) -> dict:
    return {k: _plain(v) for k, v in row.items() if k not in used}


def _named(name: str, col: str, columns: dict) -> str:
    """The column(s) a field was looked for in, as an error names them."""
    if name in columns:
        return f"'{col}' (the column mapped to {name})"
    first, *others = DEFAULT_COLUMNS[name]
    return f"'{first}'" + (f" (or {', '.join(repr(c) for c in others)})" if name == "prompt" else "")


def row_to_prompt(row, task: str, where: str, columns: dict | None = None) -> Prompt:
    """One row as a Prompt, its fields read through `columns`; DatasetError says what is wrong."""
    columns = columns or {}
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if task == "code" and not ({"prompt", "tests"} & columns.keys()) and is_livecodebench_row(row):
        try:
            rid, text, tests = livecodebench_prompt(row)
            n_public = len(public_cases(row))
        except LiveCodeBenchRowError as e:
            raise DatasetError(f"{where}: LiveCodeBench row: {e}") from None
        # Its public cases are shown in the problem text: a multi-turn episode's visible tests.
        visible = {**tests, "inputs": tests["inputs"][:n_public], "outputs": tests["outputs"][:n_public]} \
            if n_public else None
        prompt = _code_prompt(rid or where, text, tests, f"{where}: LiveCodeBench row", visible)
        prompt.row = _rest(row, LIVECODEBENCH_COLUMNS)
        return prompt
    prompt = _fields_to_prompt(row, task, where, columns)
    read = ("prompt", "answer") if task == "math" else ("prompt", "tests", "visible_tests")
    prompt.row = _rest(row, {_field(row, columns, name)[1] for name in read})
    return prompt


def _fields_to_prompt(row: dict, task: str, where: str, columns: dict) -> Prompt:
    text, col = _field(row, columns, "prompt")
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(f"{where}: no problem text in {_named('prompt', col, columns)}")
    if len(text) > MAX_PROBLEM_CHARS:
        raise DatasetError(f"{where}: a problem of {len(text):,} characters in {_named('prompt', col, columns)} "
                           f"(at most {MAX_PROBLEM_CHARS:,}: longer than any context)")
    rid, _ = _field(row, columns, "id")
    rid = where if rid is None else str(rid)
    if task == "math":
        answer, col = _field(row, columns, "answer")
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise DatasetError(f"{where}: math row has no {_named('answer', col, columns)}")
        return Prompt(rid, text, task, {"answer": str(answer)})
    tests, col = _field(row, columns, "tests")
    if tests is None:
        raise DatasetError(f"{where}: code row has no {_named('tests', col, columns)}")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: '{col}' is a string but not JSON ({e.msg})") from None
    if isinstance(tests, list):  # DeepCoder's list of {input, output} cases
        try:
            tests = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]}
        except (KeyError, TypeError):
            raise DatasetError(f"{where}: '{col}' list items need 'input' and 'output'") from None
    visible, _ = _field(row, columns, "visible_tests")
    return _code_prompt(rid, text, tests, f"{where}: code row", visible)


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


def load_file(path, task: str, columns: dict | None = None) -> list[Prompt]:
    """All usable prompts of a data set (JSONL, Parquet or a `datasets` directory); bad rows are
    logged with their file and line (or row) and skipped."""
    if task not in ("math", "code"):
        raise DatasetError(f"unknown task {task!r} (math or code)")
    try:
        data = open_data(path)
        prompts, bad = [], []
        for where, row, problem in data.rows():
            if problem:
                bad.append(problem)
                continue
            try:
                prompts.append(row_to_prompt(row, task, where, columns))
            except DatasetError as e:
                bad.append(str(e))
    except DataFileError as e:
        raise DatasetError(str(e)) from None
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


def load_prompts(dataset: str, task: str, size: int, seed: int, columns: dict | None = None,
                 system_prompt: str = "", prompt_template: str = "") -> list[Prompt]:
    """`synthetic:<task>` or a data set on disk, as Prompts asked with the system prompt and template."""
    if dataset.startswith("synthetic:"):
        kind = dataset.split(":", 1)[1]
        rows = generate_synthetic(kind, size, seed)
        if kind == "math":
            prompts = [Prompt(r["id"], r["prompt"], kind, {"answer": r["answer"]}) for r in rows]
        else:
            prompts = [Prompt(r["id"], r["problem"], kind, {"tests": r["tests"], "visible_tests": r["visible_tests"]})
                       for r in rows]
    else:
        prompts = load_file(dataset, task, columns)
    for p in prompts:
        p.system, p.template = system_prompt, prompt_template
    return prompts
