"""Requests to the reward service and its verdicts."""
from __future__ import annotations

from typing import Literal

from .codec import message


@message("grade_item")
class GradeItem:
    """One response to grade. Math: `answer`, and the problem's text as `question` (options
    and percents asked for); code: `tests` in the APPS/TACO convention; run: `response` is a
    program run once in the code sandbox with `answer` as its stdin, its verdict's details
    carrying what it printed (`stdout`) — an agent's code tool (reward/code_runner.py). `row`: the rest of the
    data set's row (its id, other columns) for a user's reward function (reward.function), which
    sees it through `item_row`; the built-in graders ignore it."""
    task: Literal["math", "code", "run"]
    response: str
    answer: str = ""
    tests: dict | None = None
    question: str = ""
    row: dict | None = None


def item_row(task: str, answer: str, tests: dict | None, row: dict | None) -> dict:
    """The row a user's reward function receives: `row` with the reference the item carries in
    its own fields (`answer` for math, `tests` for code) put back, so the sender need not send
    a code task's tests twice. A key the row has itself is kept."""
    out = dict(row or {})
    if task == "math":
        out.setdefault("answer", answer)
    elif tests is not None:
        out.setdefault("tests", tests)
    return out


@message("grade")
class GradeRequest:
    items: list[GradeItem]
    # Seconds the caller will wait; the service answers within it (timeouts become verdicts).
    deadline_s: float = 60.0


@message("verdict")
class Verdict:
    reward: float
    correct: bool
    details: dict


@message("grade_reply")
class GradeReply:
    verdicts: list[Verdict]


# Whose rules judge a code task's tests (implicit imports, how outputs compare): Tandem's own,
# or a benchmark's official grader's (docs/reward.md, "Conventions").
CODE_CONVENTIONS = ("tandem", "livecodebench")


def code_tests_problem(tests) -> str | None:
    """What is wrong with a code task's `tests` (the APPS/TACO `input_output` convention:
    `{"inputs", "outputs", "fn_name"?, "convention"?}`), or None when they can be graded. The data loader refuses
    such rows and the grader such items, by the same rule."""
    if not isinstance(tests, dict):
        return f"tests must be a map with inputs/outputs, got {type(tests).__name__}"
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return "tests.inputs and tests.outputs must be lists"
    if len(inputs) != len(outputs):
        return f"tests has {len(inputs)} inputs but {len(outputs)} outputs"
    if not inputs:
        return "tests has no test cases"
    fn_name = tests.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        return f"tests.fn_name must be a Python identifier, got {fn_name!r}"
    if fn_name is None and not all(isinstance(x, (str, list)) for x in inputs + outputs):
        return "stdin/stdout tests need text (or lists of lines) as inputs and outputs"
    if tests.get("convention", "tandem") not in CODE_CONVENTIONS:
        return f"tests.convention must be one of {list(CODE_CONVENTIONS)}, got {tests['convention']!r}"
    unknown = set(tests) - {"inputs", "outputs", "fn_name", "convention"}
    if unknown:
        return f"tests has unknown key(s) {sorted(unknown)}"
    return None
