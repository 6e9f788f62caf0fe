"""`tandem sft --task math|code|code-agent --out DIR`: the tiny model, warmed up on solved
synthetic tasks (`code-agent`: half of the rows are revision conversations, a wrong program,
the feedback the multi-turn episode gives and the right program, so RL starts from a model
that knows the feedback format). `--arch qwen3_moe` warms up the tiny Qwen3-MoE instead of the
dense Qwen2 (rollout/tiny_model.py), on the same rows: `make train-math-moe`'s model.

The embedded default runs start RL from this model. It composes pieces of other packages (the
tiny model and the synthetic tasks from `rollout`, the SFT loop from `trainer`) and caches the
result: a directory whose `sft.json` matches the requested settings is reused, so `make
train-math` pays the few minutes of warm-up once. Only a finished warm-up is cached: one stopped
before its steps (`--seconds`, Ctrl-C, SIGTERM, a kill) leaves no model and says so, and the
next run continues it from `OUT.partial.pt` (trainer/sft.py saves it every `100` steps and on a
stop) to the same model an uninterrupted warm-up makes.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tandem.rollout.tiny_model import ARCHS
from tandem.services.protocol import write_json_atomic

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# Optimizer steps (batch 64) by task. Half of code-agent's rows are revision conversations, so it
# takes twice the steps to see as many first programs as the code warm-up: with 1000, RL started
# from a first-turn pass rate 13 points below the code warm-up's and gained less.
DEFAULT_STEPS = {"math": 1000, "code": 1000, "code-agent": 2000, "agent-math": 1000}
TASKS = tuple(DEFAULT_STEPS)
DENSE = "qwen2"   # the architecture of the tiny model unless --arch says otherwise


def _boxed_accuracy(model, tok, rows, encode_prompt, max_new_tokens: int) -> float:
    """Exact match of the last \\boxed{} (enough for the integer answers of synthetic math)."""
    from tandem.trainer.sft import greedy_completions

    outs = greedy_completions(model, tok, [r["prompt"] for r in rows], encode_prompt, max_new_tokens)
    hits = 0
    for out, row in zip(outs, rows, strict=True):
        found = BOXED.findall(out)
        hits += bool(found) and found[-1].strip() == row["answer"]
    return hits / max(1, len(rows))


def _agent_math_accuracy(model, tok, rows, encode_prompt, max_new_tokens: int) -> float:
    """The calculator agent's first turn: a call of `calc` on the problem's expression (the tool
    then gives the answer) or a right \\boxed{} answer."""
    from tandem.rollout.synthetic import calculator_call
    from tandem.trainer.sft import greedy_completions

    outs = greedy_completions(model, tok, [r["prompt"] for r in rows], encode_prompt, max_new_tokens)
    hits = 0
    for out, row in zip(outs, rows, strict=True):
        found = BOXED.findall(out)
        hits += out.strip() == calculator_call(row) or (bool(found) and found[-1].strip() == row["answer"])
    return hits / max(1, len(rows))


def _code_accuracy(model, tok, rows, encode_prompt, max_new_tokens: int) -> float:
    """Runs each completion's `f` on the hidden points, through the reward package's sandbox."""
    from tandem.reward.code_grader import grade_code
    from tandem.trainer.sft import greedy_completions

    outs = greedy_completions(model, tok, [r["problem"] for r in rows], encode_prompt, max_new_tokens)
    return sum(grade_code(out, row["tests"]).correct for out, row in zip(outs, rows, strict=True)) / max(1, len(rows))


def partial_path(out: Path) -> Path:
    """Where an unfinished warm-up of `out` keeps its progress (beside it: `out` exists only once done)."""
    return out.with_name(f"{out.name}.partial.pt")


def cached(out: Path, task: str, steps: int, seed: int, arch: str = DENSE) -> tuple[dict | None, str]:
    """The marker of a finished warm-up of these settings in `out`, or None and why it is not
    used (`""`: there is none). A warm-up stopped before its steps is never used: earlier
    versions cached one stopped by the time cap; its marker says so (`steps` < `max_steps`)."""
    try:
        done = json.loads((out / "sft.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None, ""
    settings = done.get("settings") or {}
    if (done.get("task") != task or done.get("arch", DENSE) != arch or settings.get("max_steps") != steps
            or settings.get("seed") != seed):
        return None, ""
    if stopped_short(done):
        return None, f"{out} holds {describe(done)}: not using it"
    return done, ""


def stopped_short(done: dict) -> bool:
    """Whether the `sft.json` of a warm-up says it stopped before its steps."""
    ran, asked = done.get("steps"), (done.get("settings") or {}).get("max_steps")
    return done.get("complete") is False or not isinstance(ran, int) or not isinstance(asked, int) or ran < asked


def describe(done: dict) -> str:
    return (f"a warm-up stopped at step {done.get('steps')} of {(done.get('settings') or {}).get('max_steps')} "
            f"(greedy accuracy {done.get('greedy_accuracy')})")


def warm_up(task: str, out: Path, steps: int, seconds: float | None, seed: int, eval_n: int,
            force: bool = False, stop: threading.Event | None = None, clock=time.monotonic,
            checkpoint_every: int = 100, batch_size: int = 64, arch: str = DENSE) -> dict:
    """Warm the tiny model (`arch`: rollout/tiny_model.ARCHS) up, or reuse the finished warm-up
    cached in `out`. The summary's
    `complete` is False when it stopped before its steps (`seconds` on `clock`, or `stop`): then
    nothing is cached, its progress is in `partial_path(out)`, and the next call continues it."""
    from tandem.rollout.synthetic import generate
    from tandem.rollout.tiny_model import init_tiny
    from tandem.rollout.workflow import chat_prompt_ids
    from tandem.trainer.sft import SFTSettings, read_partial, train_sft

    settings = SFTSettings(max_steps=steps, seconds=seconds, seed=seed, checkpoint_every=checkpoint_every,
                           batch_size=batch_size)
    partial = partial_path(out)
    if force:
        partial.unlink(missing_ok=True)
    else:
        done, why = cached(out, task, steps, seed, arch)
        if done is not None:
            print(f"using cached warm-up model {out} ({done['steps']} steps, greedy accuracy "
                  f"{done.get('greedy_accuracy')})")
            return done
        if why:
            print(f"{why}; warming up again")
    # The dense model's identity is as it was before --arch, so its unfinished warm-ups still continue.
    identity = {"task": task, **({"arch": arch} if arch != DENSE else {}), **settings.identity()}
    resume, why = read_partial(partial, identity)
    if why:
        print(f"{why}; starting over")
        partial.unlink(missing_ok=True)
    elif resume is not None:
        print(f"continuing the unfinished warm-up from step {resume['step']} of {steps} ({partial})")
    base = Path(tempfile.mkdtemp(prefix="tandem-tiny-"))
    init_tiny(base, seed=seed, arch=arch)
    kind = {"code-agent": "code", "agent-math": "math"}.get(task, task)
    # A pool of 50,000 solved tasks, or what `steps` batches can draw if that is fewer (the default
    # steps draw more; a short warm-up need not encode 50,000 prompts first).
    rows = list(generate(kind, min(50_000, steps * settings.batch_size), seed=seed))
    if kind == "code":
        rows = [{"prompt": r["problem"], "solution": r["solution"]} for r in rows]
    if task == "code-agent":
        import random

        from tandem.rollout.code_feedback import describe_failure
        from tandem.rollout.synthetic import code_revision
        rng = random.Random(f"code-agent-{seed}")
        rows = rows + [code_revision(rng, describe_failure) for _ in range(len(rows))]
    if task == "agent-math":   # a third of first turns call the calculator; RL learns when it pays
        from tandem.rollout.synthetic import calculator_turns
        rows = rows + [turn for r in rows[:len(rows) // 2] for turn in calculator_turns(r)]
    held_out = list(generate(kind, eval_n, seed=seed + 10_000))
    max_new = 96 if kind == "math" else 48
    accuracy = {"math": _boxed_accuracy, "agent-math": _agent_math_accuracy}.get(task, _code_accuracy)

    def evaluate(model):
        from transformers import AutoTokenizer
        return accuracy(model, AutoTokenizer.from_pretrained(base), held_out, chat_prompt_ids, max_new)

    def progress(p):
        print(f"sft {task}: step {p['step']}/{steps} loss {p['loss']:.3f} {p['tokens_per_s']:,.0f} tok/s "
              f"{p['elapsed_s']:.0f}s", flush=True)

    try:
        summary = train_sft(base, rows, out, settings, encode_prompt=chat_prompt_ids,
                            evaluate=evaluate if eval_n else None, progress=progress, partial=partial,
                            resume=resume, identity=identity, stop=stop, clock=clock)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary["task"] = task
    summary["arch"] = arch
    if not summary["complete"]:
        print(f"warm-up stopped at step {summary['steps']} of {steps} by {summary['stopped_by']}: not cached "
              f"as done, and {out} was not written. Its progress is kept in {partial}: the same command "
              f"continues from step {summary['steps']} (--force starts over).", flush=True)
        return summary
    write_json_atomic(out / "sft.json", summary)    # a warm-up stopped mid-write is redone, not half-read
    print(f"warm-up done: {summary['steps']} steps, greedy accuracy {summary.get('greedy_accuracy')} "
          f"on {eval_n} held-out problems -> {out}")
    return summary


class StopRequest(threading.Event):
    """Set by the first SIGINT or SIGTERM; `signum` says which."""
    signum = 0


@contextmanager
def stop_on_signals():
    """SIGINT (Ctrl-C) and SIGTERM set the event this yields: the warm-up saves its progress
    after the step it is in and stops. A second Ctrl-C stops at once (KeyboardInterrupt); the
    last periodic save is then what the next run continues from."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()
        stop.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping the warm-up after this step and keeping its "
              f"progress (Ctrl-C again stops at once)", flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def cmd_sft(args) -> int:
    if args.task not in TASKS:
        print(f"tandem sft: --task must be one of {', '.join(TASKS)}, got {args.task!r}", file=sys.stderr)
        return 2
    if args.arch not in ARCHS:
        print(f"tandem sft: --arch must be one of {', '.join(ARCHS)}, got {args.arch!r}", file=sys.stderr)
        return 2
    if args.seconds is not None and args.seconds <= 0:
        print(f"tandem sft: --seconds must be > 0, got {args.seconds:g}", file=sys.stderr)
        return 2
    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.task]
    with stop_on_signals() as stop:
        summary = warm_up(args.task, Path(args.out), steps, args.seconds, args.seed, args.eval_n, args.force,
                          stop=stop, arch=args.arch)
    if summary.get("complete", True):
        return 0
    # Stopped by a signal: the shell's convention (130 for Ctrl-C); by the time cap: 3. Either way
    # not 0, so `make train-math` does not go on to RL from a model that was never finished.
    return 128 + stop.signum if stop.is_set() else 3


def register(sub) -> None:
    p = sub.add_parser("sft", help="warm up the tiny model on solved synthetic tasks (cached)")
    p.add_argument("--task", required=True, help="math, code, code-agent (with revision conversations) or agent-math (with calculator calls)")
    p.add_argument("--out", required=True, help="output Hugging Face directory")
    p.add_argument("--arch", default=DENSE,
                   help=f"the tiny model's architecture: {DENSE} (dense, the default) or qwen3_moe (8 experts, "
                        "top 2: make train-math-moe's)")
    # Steps, not seconds, so the cached model is the same on a busy machine as on an idle one.
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (batch 64); default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()))
    p.add_argument("--seconds", type=float, default=None,
                   help="time cap: stop after this many seconds of training, keep the progress in OUT.partial.pt "
                        "and exit 3 without caching (the same command continues it); default: no cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=200, help="held-out problems for the accuracy check")
    p.add_argument("--force", action="store_true", help="retrain even if a cached model matches")
    p.set_defaults(func=cmd_sft)
