"""Programs an agent's tool runs (`GradeItem(task="run")`): the code sandbox, and what they printed.

An agent that lets the model run Python (a calculator that is a program, a data tool) must not
run it in the rollout worker: the policy is an adversary, and the worker holds the run's keys.
The reward service already runs model-written programs under every limit of the code grader
(docs/reward.md: bwrap, seccomp, memory, processes, time, output), so a tool's program is one
more job for it: run once with the given stdin, its stdout back (the first RUN_OUTPUT_CHARS
characters), its status (`ok`, or why it stopped: time limit, error, ...), the tail of its
stderr. Nothing is graded: reward 0, `correct` says whether it ran to its end.
"""
from __future__ import annotations

from tandem.reward.code_grader import sandbox_for
from tandem.reward.config import RewardConfig
from tandem.reward.sandbox import UNISOLATED
from tandem.services.protocol import Verdict

RUN_OUTPUT_CHARS = 4000
# An expected output no program prints, so the harness keeps what the program did print.
_NEVER = "\x00tandem: no expected output\x00"


def run_program(program: str, stdin: str, cfg: RewardConfig) -> Verdict:
    sandbox = sandbox_for(cfg)
    if sandbox.isolation != "bwrap" and not cfg.allow_unisolated:
        return Verdict(0.0, False, {"task": "run", "status": "refused", "reason": UNISOLATED, "stdout": ""})
    result = sandbox.run(program, [stdin], [_NEVER], None, "tandem", shown_chars=RUN_OUTPUT_CHARS)
    if result.error or not result.tests:
        return Verdict(0.0, False, {"task": "run", "status": "sandbox error", "reason": result.error or "no result",
                                    "stdout": "", "seconds": round(result.seconds, 3)})
    rec = result.tests[0]
    status = "ok" if rec.get("status") in ("wrong output", "passed") else str(rec.get("status", "failed"))
    return Verdict(0.0, status == "ok", {"task": "run", "status": status, "stdout": rec.get("got", ""),
                                         "stderr": rec.get("stderr", ""), "seconds": round(result.seconds, 3)})
