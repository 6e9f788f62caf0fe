"""Grader time of programs that try to outlast their limits, as root and as an ordinary user.

A sandboxed task has a wall-clock limit (`reward.code_total_timeout_s`, each test
`code_test_timeout_s`); what matters to a reward worker is how long it is held past that limit.
Each row runs one attack a few times and reports the median grader time (start to verdict,
`SandboxResult.seconds`) against the task's limit (`code_total_timeout_s`: what bounds a
worker's time whatever the program does; most attacks end at their test's limit, well before). Before the absolute
deadline, a program that closed its pipes and slept held a 1-test task for the grader's whole
grace period (35 s against a 5 s limit, as reported in the issue); the goal is at most 100 ms.
The unprivileged grader runs this module again as a real ordinary user with no cgroup to write
(tests/support/grader_users.py: a mount namespace hiding /sys/fs/cgroup, then setpriv), as on
clusters, where the program can signal the harness (`stop_the_harness`) and only the harness's
watch and the kernel's per-user limits bound the sandbox as a whole. (`unshare --map-user`
kept real uid 0: the kernel's process limit never applied and the host's cgroup stayed writable.)
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import cli, print_table, write_results
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import Sandbox

TEST_S, TOTAL_S = 1.0, 3.0
# name -> (program, number of tests)
ATTACKS = {
    "infinite loop": ("while True:\n    pass", 1),
    "closes its pipes, then sleeps": ("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", 1),
    "stops itself (SIGSTOP)": ("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", 1),
    "stops the harness (SIGSTOP)": ("import os, signal, time\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\n"
                                    "except OSError:\n    pass\ntime.sleep(60)", 1),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 1),
    "sleeping children hold the pipes": ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
                                         "        time.sleep(60)\nprint('x')", 1),
    "memory hog": ("a = []\nwhile True:\n    a.append(bytearray(10 << 20))", 1),
    "output flood": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", 1),
    "every test loops (total limit)": ("while True:\n    pass", 6),
    # issue 61: killed and reaped after its test, no longer kept (and spinning) for the whole task
    "each test leaves a spinner in its own session": ("import os\nif os.fork() == 0:\n    os.setsid()\n"
                                                     "    while True:\n        pass\nprint('x')", 6),
}


def _measure(repeats: int, cgroup: bool = True) -> dict[str, dict]:
    cfg = RewardConfig(code_test_timeout_s=TEST_S, code_total_timeout_s=TOTAL_S, code_memory_mb=256,
                       sandbox_cgroup=cgroup)
    sandbox = Sandbox(cfg)
    out = {}
    for name, (program, n) in ATTACKS.items():
        runs = [sandbox.run(program, [""] * n, ["never"] * n) for _ in range(repeats)]
        out[name] = {"seconds": statistics.median(r.seconds for r in runs), "limit_s": TOTAL_S,
                     "ended_by": runs[-1].error or (runs[-1].tests[0]["status"] if runs[-1].tests else "?"),
                     "limits": sandbox.limits}
    return out


def main(quick: bool = False) -> dict:
    repeats = 1 if quick else 5
    if Sandbox(RewardConfig()).isolation != "bwrap":
        raise SystemExit("bubblewrap is not usable here: nothing to measure")
    graders = {"root" if os.getuid() == 0 else "this user": _measure(repeats)}
    if shutil.which("unshare") and shutil.which("setpriv") and os.getuid() == 0:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
        from grader_users import CHECKOUT, user_prefix  # the tests' ordinary user (real_users.py)
        r = subprocess.run([*user_prefix(), sys.executable, "-m", "benchmarks.sandbox_attacks", "--inner", str(repeats)],
                           capture_output=True, text=True, check=True, cwd=CHECKOUT,
                           env={**os.environ, "PYTHONPATH": CHECKOUT})
        graders["unprivileged user"] = json.loads(r.stdout)
    rows, worst = [], 0.0
    for grader, results in graders.items():
        for name, r in results.items():
            over_ms = (r["seconds"] - r["limit_s"]) * 1e3
            worst = max(worst, over_ms)
            rows.append([grader, name, r["limits"], r["ended_by"][:40], round(r["seconds"], 3), round(over_ms, 1)])
    print_table(f"grader time of attacks on the time limits (median of runs; test limit {TEST_S} s, task limit {TOTAL_S} s)",
                ["grader", "attack", "memory/process limits", "ended by", "grader s", "ms past the task limit"], rows)
    headline = {"worst_ms_past_limit": round(worst, 1), "test_timeout_s": TEST_S, "total_timeout_s": TOTAL_S}
    if not quick:
        write_results("sandbox_attacks", headline)
    return headline


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        print(json.dumps(_measure(int(sys.argv[2]), cgroup=False)))
    else:
        cli(main)
