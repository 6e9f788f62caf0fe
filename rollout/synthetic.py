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


def code_problem(rng: random.Random) -> dict:
    """"f(1)=3, f(2)=5, f(4)=9" → `def f(x): return 2*x+1`, graded on hidden points."""
    template, fn = rng.choice(CODE_TEMPLATES)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    shown = sorted(rng.sample(range(0, 8), 3))
    hidden = [x for x in range(-3, 11) if x not in shown][:8]
    problem = ", ".join(f"f({x})={fn(a, b, x)}" for x in shown)
    source = template.format(a=a, b=b)
    points = shown + hidden
    return {"problem": problem, "solution": f"```python\n{source}\n```",
            "tests": {"fn_name": "f", "inputs": [[x] for x in points],
                      "outputs": [fn(a, b, x) for x in points]}}


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
