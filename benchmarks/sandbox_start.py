"""Where a code sandbox's start-up goes, each part measured beside its alternative in one run.

A code task pays one sandbox start (bubblewrap + the interpreter + the harness), so its cost
bounds how many tasks a reward worker grades per second. Each row is the median of interleaved
rounds, so a noisy minute shifts every row alike: the interpreter alone; bubblewrap with the
host bound read-only (the sandbox before the fresh root), with the fresh root binding each
shared library alone, and with the libraries gathered into two mounts (today); `import ctypes`
against `_ctypes`; compiling the harness's source (what a marshalled code object saves); the
first `compile()` of a process (what the harness's warm-up saves in every forked test); and
the whole sandbox for a 1-test task of each kind, and with LiveCodeBench's implicit imports.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import statistics
import subprocess
import time
from unittest import mock

from benchmarks.common import cli, print_table, write_results
from tandem.reward import sandbox_root
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import BWRAP_FLAGS, HARNESS, INTERPRETER, Sandbox

PYTHON = [INTERPRETER, "-I", "-S", "-c"]
FIRST_COMPILE = ("import time; t = time.perf_counter(); compile('', '<w>', 'exec'); "
                 "print((time.perf_counter() - t) * 1e3)")


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]}... failed: {proc.stderr[-300:]}")
    return proc


def main(quick: bool = False) -> dict:
    rounds, per_round = (2, 3) if quick else (10, 10)
    sandbox = Sandbox(RewardConfig())
    if sandbox.isolation != "bwrap":
        raise SystemExit("bubblewrap is not usable here: nothing to measure")
    with mock.patch.object(sandbox_root, "library_stage", lambda prefix: None):
        per_library = sandbox_root.bwrap_root_args.__wrapped__()   # past the cache of the gathered form
    gathered = sandbox_root.bwrap_root_args()
    inside = ["--tmpfs", "/tmp", "--dir", "/tmp/work"]
    commands = {
        "interpreter -I -S, nothing to run": [*PYTHON, "pass"],
        "+ bubblewrap, host bound read-only (before the fresh root)":
            ["bwrap", "--ro-bind", "/", "/", *BWRAP_FLAGS, *inside, *PYTHON, "pass"],
        "+ bubblewrap, fresh root, one mount per library":
            ["bwrap", *BWRAP_FLAGS, *per_library, *inside, *PYTHON, "pass"],
        "+ bubblewrap, fresh root, libraries gathered (today)":
            ["bwrap", *BWRAP_FLAGS, *gathered, *inside, *PYTHON, "pass"],
        "interpreter, import ctypes": [*PYTHON, "import ctypes"],
        "interpreter, import _ctypes (today)": [*PYTHON, "import _ctypes"],
    }
    tasks = {
        "whole sandbox, 1-test function-call task": ("def f(x):\n    return x", [[1]], [1], "f"),
        "whole sandbox, 1-test stdin/stdout task": ("print(input())", ["x"], ["x"], None),
        "whole sandbox, 1-test stdin/stdout task, LiveCodeBench's imports":
            ("print(input())", ["x"], ["x"], None, "livecodebench"),
    }
    # The same sandbox without its per-task cgroup (per-process limits and the harness's watch,
    # as under a non-root grader): what the cgroup costs.
    no_cgroup = Sandbox(RewardConfig(sandbox_cgroup=False))
    tasks_without_cgroup = {"whole sandbox, 1-test function-call task, no cgroup": ("def f(x):\n    return x", [[1]], [1], "f")}
    samples: dict[str, list[float]] = {name: [] for name in [*commands, *tasks, *tasks_without_cgroup]}
    samples["compiling the harness's source"] = []
    samples["first compile() of a process"] = []
    for _ in range(rounds):
        for _ in range(per_round):
            for name, cmd in commands.items():
                samples[name].append(_ms(lambda cmd=cmd: _run(cmd)))
            for name, args in tasks.items():
                samples[name].append(_ms(lambda args=args: sandbox.run(*args)))
            for name, args in tasks_without_cgroup.items():
                samples[name].append(_ms(lambda args=args: no_cgroup.run(*args)))
            samples["compiling the harness's source"].append(_ms(lambda: compile(HARNESS, "h", "exec")))
            samples["first compile() of a process"].append(float(_run([*PYTHON, FIRST_COMPILE]).stdout))
    ms = {name: statistics.median(v) for name, v in samples.items()}
    names = list(ms)
    base = ms["interpreter -I -S, nothing to run"]
    rows = [[name, ms[name], ms[name] - base if name.startswith(("+", "interpreter,")) else ""] for name in names]
    print_table("sandbox start-up (median ms)", ["part", "ms", "ms over the bare interpreter"], rows)
    headline = {
        "interpreter_ms": round(base, 1),
        "bwrap_host_ro_ms": round(ms["+ bubblewrap, host bound read-only (before the fresh root)"], 1),
        "bwrap_mount_per_library_ms": round(ms["+ bubblewrap, fresh root, one mount per library"], 1),
        "bwrap_gathered_ms": round(ms["+ bubblewrap, fresh root, libraries gathered (today)"], 1),
        "import_ctypes_ms": round(ms["interpreter, import ctypes"] - base, 1),
        "import_underscore_ctypes_ms": round(ms["interpreter, import _ctypes (today)"] - base, 1),
        "harness_compile_ms": round(ms["compiling the harness's source"], 1),
        "first_compile_ms": round(ms["first compile() of a process"], 1),
        "call_task_ms": round(ms["whole sandbox, 1-test function-call task"], 1),
        "call_task_no_cgroup_ms": round(ms["whole sandbox, 1-test function-call task, no cgroup"], 1),
        "limits": sandbox.limits,
        "stdio_task_ms": round(ms["whole sandbox, 1-test stdin/stdout task"], 1),
        "stdio_task_livecodebench_ms": round(ms["whole sandbox, 1-test stdin/stdout task, LiveCodeBench's imports"], 1),
    }
    if not quick:
        write_results("sandbox_start", headline)
    return headline


if __name__ == "__main__":
    cli(main)
