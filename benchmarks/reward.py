"""Reward service throughput: math verdicts/s through the service (pool of 2) vs math-verify in
one process, and the code sandbox's cost per test and tasks/s through the pool; the cost of a
pathological math answer, and a batch graded alone vs mixed with pathological answers."""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results
from tandem.reward.code_grader import grade_code
from tandem.reward.config import RewardConfig
from tandem.reward.math_grader import grade_math
from tandem.services.protocol import (
    ExpDir,
    GradeItem,
    GradeRequest,
    RequestClient,
    generate_keys,
    load_keys,
    read_service,
)

# Templates of (response, answer): integers, fractions, \frac, intervals, thousands separators,
# text around boxes; right and wrong. Every item differs (math-verify caches parses of repeats).
MATH = [
    (r"We compute {a}*{a} = {aa}, so \boxed{{{aa}}}.", "{aa}"),
    (r"<think>try {a}/{b}</think>The answer is \boxed{{\frac{{{a}}}{{{b}}}}}", "{a}/{b}"),
    (r"Hence \boxed{{\dfrac{{{b}}}{{{a}}}}}", "{b}/{a}"),
    (r"The set is \boxed{{[{a}, {b})}}", "[{a},{b})"),
    (r"So x = \boxed{{-{a}}}", "{a}"),
    (r"Total: \boxed{{{a},{b:03d}}}", "{a}{b:03d}"),
    (r"It is \boxed{{\sqrt{{{a}}}}}", "\\sqrt{{{a}}}"),
    (r"The final answer is {a}", "{b}"),
]


def math_item(n: int) -> tuple[str, str]:
    response, answer = MATH[n % len(MATH)]
    a, b = 2 + n // len(MATH), 7 + (n * 7919) % 991
    return response.format(a=a, b=b, aa=a * a), answer.format(a=a, b=b, aa=a * a)


# Answers whose symbolic grading takes seconds (issue 22); the answer contract refuses them.
PATHOLOGICAL = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10^{10^{10}}}", r"\boxed{100000!}",
                r"\boxed{(x+1)^{100000}}", r"\boxed{" + "{" * 200 + "1" + "}" * 200 + "}"]

CODE_TESTS = {"fn_name": "f", "inputs": [[i] for i in range(20)], "outputs": [2 * i + 1 for i in range(20)]}
CODE_RESPONSE = "```python\ndef f(x):\n    return 2 * x + 1\n```"
CODE_STDIO_RESPONSE = "```python\nx = int(input())\nprint(2 * x + 1)\n```"


def math_direct(seconds: float) -> float:
    cfg = RewardConfig()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        grade_math(*math_item(n), cfg)
        n += 1
    return n / (time.perf_counter() - t0)


def pathological_ms(reps: int) -> float:
    """Mean ms to grade one pathological answer in one process."""
    cfg = RewardConfig()
    t0 = time.perf_counter()
    for _ in range(reps):
        for answer in PATHOLOGICAL:
            assert not grade_math(answer, "1", cfg).correct
    return (time.perf_counter() - t0) / (reps * len(PATHOLOGICAL)) * 1e3


async def batch_seconds(exp: ExpDir, items: list[GradeItem]) -> float:
    """Seconds the service takes to grade one request of `items`."""
    c = RequestClient(load_keys(exp.keys), read_service(exp, "reward", timeout_s=60)["address"], timeout_s=300)
    try:
        t0 = time.perf_counter()
        await c.request(GradeRequest(items=items, deadline_s=290))
        return time.perf_counter() - t0
    finally:
        c.close()


def code_direct(reps: int) -> dict[str, float]:
    """ms per test of a 20-test task and ms per 1-test task (start + limits + teardown), for
    function-call and stdin/stdout tests."""
    cfg = RewardConfig()
    stdio = {"inputs": [f"{i}\n" for i in range(20)], "outputs": [f"{2 * i + 1}\n" for i in range(20)]}
    cases = {"call": (CODE_RESPONSE, CODE_TESTS), "stdio": (CODE_STDIO_RESPONSE, stdio)}
    grade_code(CODE_RESPONSE, CODE_TESTS, cfg)  # probe bubblewrap once
    out = {}
    for mode, (response, tests) in cases.items():
        one = {k: v[:1] if isinstance(v, list) else v for k, v in tests.items()}
        for name, task, per in ((f"{mode}_ms_per_test", tests, len(tests["inputs"])), (f"{mode}_ms_per_sandbox", one, 1)):
            t0 = time.perf_counter()
            for _ in range(reps):
                assert grade_code(response, task, cfg).correct
            out[name] = (time.perf_counter() - t0) / reps / per * 1e3
    return out


def start_service(root: Path, workers: int) -> subprocess.Popen:
    from tandem.launcher.config import load_config, save_resolved
    exp = ExpDir(root)
    generate_keys(exp.keys)
    save_resolved(load_config(None, ["experiment.name=bench-reward", "experiment.model=none",
                                     f"experiment.exp_dir={root}", f"reward.num_workers={workers}"]), root)
    tandem = Path(sys.executable).with_name("tandem")
    return subprocess.Popen([str(tandem), "reward", "serve", "--exp", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def through_service(exp: ExpDir, items, seconds: float, clients: int = 4) -> float:
    """Items graded per second with `clients` concurrent clients, each sending `items()` batches."""
    keys = load_keys(exp.keys)
    address = read_service(exp, "reward", timeout_s=60)["address"]
    done = 0
    stop = time.perf_counter() + seconds

    async def client():
        nonlocal done
        c = RequestClient(keys, address, timeout_s=120)
        try:
            while time.perf_counter() < stop:
                reply = await c.request(GradeRequest(items=items(), deadline_s=110))
                done += len(reply.verdicts)
        finally:
            c.close()

    await client_warmup(keys, address)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


async def client_warmup(keys, address) -> None:
    c = RequestClient(keys, address, timeout_s=120)
    try:
        await c.request(GradeRequest(items=[GradeItem(task="math", response=r"\boxed{1}", answer="1")] * 4))
    finally:
        c.close()


def main(quick: bool = False) -> dict:
    seconds, reps = (1.0, 3) if quick else (10.0, 30)
    direct = math_direct(seconds)
    pathological = pathological_ms(reps)
    code = code_direct(reps)
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-reward-")) / "exp"
    proc = start_service(root, workers=2)
    try:
        exp = ExpDir(root)
        counter = iter(range(10**6, 10**9))  # different numbers than the direct run's

        def math_items():
            return [GradeItem(task="math", response=r, answer=a)
                    for r, a in (math_item(next(counter)) for _ in range(32))]

        service = asyncio.run(through_service(exp, math_items, seconds))
        code_items = [GradeItem(task="code", response=CODE_RESPONSE, tests=CODE_TESTS)] * 4
        tasks = asyncio.run(through_service(exp, lambda: code_items, seconds, clients=2))
        isolation = read_service(exp, "reward")["isolation"]
        alone = asyncio.run(batch_seconds(exp, math_items()))
        bad = [GradeItem(task="math", response=a, answer="1") for a in PATHOLOGICAL] * 8
        mixed = asyncio.run(batch_seconds(exp, math_items() + bad))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print_table("reward", ["measure", "value"], [
        ["math verdicts/s, direct (one process)", direct],
        ["math verdicts/s, service (pool of 2)", service],
        ["service / direct", service / direct],
        [f"code ms per test (20 function-call tests per sandbox, {isolation})", code["call_ms_per_test"]],
        ["code ms per 1-test task (start + limits + teardown)", code["call_ms_per_sandbox"]],
        ["code ms per test (20 stdin/stdout tests per sandbox)", code["stdio_ms_per_test"]],
        ["code ms per 1-test stdin/stdout task", code["stdio_ms_per_sandbox"]],
        ["code tasks/s through the service (20 tests each)", tasks],
        ["math ms per pathological answer (9^{9^{9^{9}}}, 100000!, ...)", pathological],
        ["s for 32 answers through the service, alone", alone],
        ["s for the same + 40 pathological answers", mixed],
        ["cpus", os.cpu_count()],
    ])
    headline = {"math_per_s_service": round(service, 1), "math_per_s_direct": round(direct, 1),
                "code_ms_per_test": round(code["call_ms_per_test"], 2),
                "code_ms_per_sandbox": round(code["call_ms_per_sandbox"], 1),
                "code_stdio_ms_per_test": round(code["stdio_ms_per_test"], 2),
                "code_stdio_ms_per_sandbox": round(code["stdio_ms_per_sandbox"], 1),
                "code_tasks_per_s": round(tasks, 1), "code_isolation": isolation,
                "math_ms_per_pathological": round(pathological, 3), "batch_alone_s": round(alone, 3),
                "batch_with_pathological_s": round(mixed, 3)}
    if not quick:
        write_results("reward", headline)
    return headline


if __name__ == "__main__":
    cli(main)
