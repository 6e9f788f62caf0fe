"""A grader worker process: grades one item at a time for the pool (see reward.pool).

Runs as `python -m tandem.reward.worker`, in its own session so the pool can kill it and everything it
started. Frames on stdin/stdout are 4-byte big-endian lengths + msgpack. The first frame in is
the RewardConfig (a map); the worker answers {"ready": pid} once its imports are done, then one
reply per job: {"id", "reward", "correct", "details"}. Grading happens on the main thread, so
the math grader's own interval timer works; the pool's hard limit is the backstop.

With `reward.function` or `reward.url` every job is scored by the user's reward instead
(reward/user_function.py, reward/remote_reward.py). The function is imported before "ready": one
that does not import makes the worker answer {"error": why} instead and exit, so the service
refuses to start with that reason rather than answering every item with a refusal.
"""
from __future__ import annotations

import os
import struct
import sys

import msgpack

from tandem.reward.config import RewardConfig
from tandem.services.protocol.grading import item_row

_LEN = struct.Struct(">I")
SHOWN_REFUSALS = 3  # refusals of a user's reward written to the service's log, per worker


def read_frame(stream) -> dict | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    body = stream.read(_LEN.unpack(head)[0])
    return msgpack.unpackb(body, raw=False)


def write_frame(stream, obj: dict) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def user_grader(cfg: RewardConfig):
    """The user's reward of this config (function or endpoint), or None for the built-in graders."""
    if cfg.url:
        from tandem.reward.remote_reward import RemoteGrader
        return RemoteGrader(cfg)
    if cfg.function:
        from tandem.reward.user_function import FunctionGrader
        return FunctionGrader(cfg)
    return None


def grade_item(cfg: RewardConfig, job: dict, user=None) -> dict:
    from tandem.reward.code_grader import grade_code
    from tandem.reward.math_grader import grade_math

    if job.get("task") == "run":   # an agent's code tool: the sandbox, never the user's reward
        from tandem.reward.code_runner import run_program
        v = run_program(job.get("response", ""), job.get("answer") or "", cfg)
    elif user is not None:
        task = job.get("task", "")
        row = item_row(task, job.get("answer") or "", job.get("tests"), job.get("row"))
        v = user.grade(task, job.get("question") or "", job.get("response", ""), row)
    elif job.get("task") == "code":
        v = grade_code(job.get("response", ""), job.get("tests"), cfg)
    else:
        v = grade_math(job.get("response", ""), job.get("answer", ""), cfg, question=job.get("question") or "")
    return {"reward": v.reward, "correct": v.correct, "details": v.details}


def main() -> int:
    # Our replies own the real stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = os.fdopen(0, "rb")
    raw = read_frame(inp)
    if raw is None:
        return 1
    cfg = RewardConfig(**raw)
    try:
        user = user_grader(cfg)
    except ValueError as e:   # RewardFunctionError: the function does not import here
        write_frame(out, {"ready": os.getpid(), "error": f"reward.function {e}"})
        return 2
    import tandem.reward.code_grader  # noqa: F401  (pay the imports and the bwrap probe before "ready")
    import tandem.reward.math_grader  # noqa: F401
    from tandem.reward.code_grader import sandbox_for
    isolation = sandbox_for(cfg).isolation
    write_frame(out, {"ready": os.getpid(), "isolation": isolation})
    shown = 0
    while (job := read_frame(inp)) is not None:
        try:
            reply = grade_item(cfg, job, user)
            if reply["details"].get("refused") and shown < SHOWN_REFUSALS:
                shown += 1
                print(f"reward worker {os.getpid()}: {reply['details']['reason']}"
                      + (" (further refusals are only counted: user_refused)" if shown == SHOWN_REFUSALS else ""),
                      file=sys.stderr, flush=True)
        except Exception as e:  # a grader bug answers as an error verdict; the worker goes on
            reply = {"reward": cfg.wrong_reward, "correct": False,
                     "details": {"task": job.get("task"), "error": f"grader failed: {type(e).__name__}: {e}"[:500],
                                 "reason": "grader error"}}
        write_frame(out, {"id": job["id"], **reply})
    if user is not None and hasattr(user, "close"):
        user.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
