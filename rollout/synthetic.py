"""Synthetic tasks with checkable answers for the embedded default runs.

They are shaped like the real data sets (math rows `{prompt, answer}`, code rows `{problem,
tests}` in the APPS/TACO convention) so the same readers, graders and workflow serve both, and
their solution lengths are long-tailed on purpose: that spread is what makes asynchrony matter.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

# Operation counts are skewed: most problems are short, a few are several times longer.
OP_COUNT_WEIGHTS = {1: 0.30, 2: 0.28, 3: 0.20, 4: 0.14, 5: 0.08}


def _reduce_once(tokens: list[str]) -> list[str]:
    """Apply the first operation by precedence (* before + and -), left to right."""
    idx = next((i for i in range(1, len(tokens), 2) if tokens[i] == "*"), 1)
    a, op, b = int(tokens[idx - 1]), tokens[idx], int(tokens[idx + 1])
    value = a * b if op == "*" else a + b if op == "+" else a - b
    return tokens[: idx - 1] + [str(value)] + tokens[idx + 2:]


def math_problem(rng: random.Random) -> dict:
    """`13*15-7-1-5` with the worked solution `13*15-7-1-5=195-7-1-5=...=182 \\boxed{182}`."""
    n_ops = rng.choices(list(OP_COUNT_WEIGHTS), weights=list(OP_COUNT_WEIGHTS.values()))[0]
    tokens = [str(rng.randint(1, 15))]
    for _ in range(n_ops):
        tokens += [rng.choice("+-*"), str(rng.randint(1, 15))]
    expr = "".join(tokens)
    steps = [expr]
    while len(tokens) > 1:
        tokens = _reduce_once(tokens)
        steps.append("".join(tokens))
    answer = tokens[0]
    return {"prompt": f"{expr}=?", "answer": answer,
            "solution": "=".join(steps) + f" \\boxed{{{answer}}}"}


CODE_TEMPLATES = [
    # (source template, function of (a, b, x)) — quadratic and linear families.
    ("def f(x): return x*x+{b}", lambda a, b, x: x * x + b),
    ("def f(x): return x*x-{b}", lambda a, b, x: x * x - b),
    ("def f(x): return {a}*x+{b}", lambda a, b, x: a * x + b),
    ("def f(x): return {a}*x-{b}", lambda a, b, x: a * x - b),
    ("def f(x): return x*x+{a}*x", lambda a, b, x: x * x + a * x),
]


def _point_tests(fn, a, b, points) -> dict:
    return {"fn_name": "f", "inputs": [[x] for x in points], "outputs": [fn(a, b, x) for x in points]}


def code_problem(rng: random.Random) -> dict:
    """"f(1)=3, f(2)=5, f(4)=9" → `def f(x): return 2*x+1`. The three points of the text are the
    visible tests (a multi-turn episode's feedback runs them); the reward's tests add eight
    points never shown."""
    template, fn = rng.choice(CODE_TEMPLATES)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    shown = sorted(rng.sample(range(0, 8), 3))
    hidden = [x for x in range(-3, 11) if x not in shown][:8]
    problem = ", ".join(f"f({x})={fn(a, b, x)}" for x in shown)
    source = template.format(a=a, b=b)
    return {"problem": problem, "solution": f"```python\n{source}\n```",
            "tests": _point_tests(fn, a, b, shown + hidden), "visible_tests": _point_tests(fn, a, b, shown),
            "params": [CODE_TEMPLATES.index((template, fn)), a, b]}


def code_revision(rng: random.Random, describe_failure) -> dict:
    """A warm-up conversation for the multi-turn code episode: a wrong first program (a nearby
    constant or another family), the feedback the episode would give on the first visible point
    it fails, then the right program. `describe_failure(fn_name, args, got, expected)` is the
    episode's own feedback text, so the warm-up teaches exactly the format RL will show."""
    row = code_problem(rng)
    k, a, b = row["params"]
    template, fn = CODE_TEMPLATES[k]
    shown = [args[0] for args in row["visible_tests"]["inputs"]]
    while True:
        k2 = k if rng.random() < 0.6 else rng.randrange(len(CODE_TEMPLATES))
        a2, b2 = max(2, a + rng.choice([-2, -1, 0, 1, 2])), max(1, b + rng.choice([-3, -2, -1, 1, 2, 3]))
        wrong_t, wrong_fn = CODE_TEMPLATES[k2]
        miss = next((x for x in shown if wrong_fn(a2, b2, x) != fn(a, b, x)), None)
        if miss is not None:
            break
    wrong = f"```python\n{wrong_t.format(a=a2, b=b2)}\n```"
    feedback = describe_failure("f", [miss], repr(wrong_fn(a2, b2, miss)), fn(a, b, miss))
    return {"prompt": [{"role": "user", "content": row["problem"]}, {"role": "assistant", "content": wrong},
                       {"role": "user", "content": feedback}],
            "solution": row["solution"]}


def calculator_call(row: dict) -> str:
    """The calculator agent's tool call on a math row (rollout/agents/calculator.py), as the
    warm-up teaches it: Hermes `<tool_call>` JSON, compact."""
    call = {"name": "calc", "arguments": {"expression": row["prompt"].removesuffix("=?")}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def calculator_turns(row: dict) -> list[dict]:
    """Warm-up rows of a calculator episode on a math row: the call, then the answer after the
    tool's result (the conversation as the episode renders it)."""
    call = calculator_call(row)
    after = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": call},
             {"role": "tool", "content": row["answer"]}]
    return [{"prompt": row["prompt"], "solution": call},
            {"prompt": after, "solution": f"\\boxed{{{row['answer']}}}"}]


GENERATORS = {"math": math_problem, "code": code_problem}


def generate(task: str, n: int, seed: int) -> Iterator[dict]:
    if task not in GENERATORS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {sorted(GENERATORS)}")
    rng = random.Random(f"{task}-{seed}")
    for i in range(n):
        row = GENERATORS[task](rng)
        yield {"id": f"{task}-{seed}-{i}", **row}


def write_jsonl(path: str | Path, rows) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path
