"""`tandem sft --task math|code|code-agent --out DIR`: the tiny model, warmed up on solved
synthetic tasks (`code-agent`: half of the rows are revision conversations, a wrong program,
the feedback the multi-turn episode gives and the right program, so RL starts from a model
that knows the feedback format).

The embedded default runs start RL from this model. It composes pieces of other packages (the
tiny model and the synthetic tasks from `rollout`, the SFT loop from `trainer`) and caches the
result: a directory whose `sft.json` matches the requested settings is reused, so `make
train-math` pays the few minutes of warm-up once.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from tandem.services.protocol import write_json_atomic

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# Optimizer steps (batch 64) by task. Half of code-agent's rows are revision conversations, so it
# takes twice the steps to see as many first programs as the code warm-up: with 1000, RL started
# from a first-turn pass rate 13 points below the code warm-up's and gained less.
DEFAULT_STEPS = {"math": 1000, "code": 1000, "code-agent": 2000}


def _boxed_accuracy(model, tok, rows, encode_prompt, max_new_tokens: int) -> float:
    """Exact match of the last \\boxed{} (enough for the integer answers of synthetic math)."""
    from tandem.trainer.sft import greedy_completions

    outs = greedy_completions(model, tok, [r["prompt"] for r in rows], encode_prompt, max_new_tokens)
    hits = 0
    for out, row in zip(outs, rows, strict=True):
        found = BOXED.findall(out)
        hits += bool(found) and found[-1].strip() == row["answer"]
    return hits / max(1, len(rows))


def _code_accuracy(model, tok, rows, encode_prompt, max_new_tokens: int) -> float:
    """Runs each completion's `f` on the hidden points, through the reward package's sandbox."""
    from tandem.reward.code_grader import grade_code
    from tandem.trainer.sft import greedy_completions

    outs = greedy_completions(model, tok, [r["problem"] for r in rows], encode_prompt, max_new_tokens)
    return sum(grade_code(out, row["tests"]).correct for out, row in zip(outs, rows, strict=True)) / max(1, len(rows))


def warm_up(task: str, out: Path, steps: int, seconds: float, seed: int, eval_n: int,
            force: bool = False) -> dict:
    from tandem.rollout.synthetic import generate
    from tandem.rollout.tiny_model import init_tiny
    from tandem.rollout.workflow import chat_prompt_ids
    from tandem.trainer.sft import SFTSettings, train_sft

    settings = SFTSettings(max_steps=steps, seconds=seconds, seed=seed)
    marker = out / "sft.json"
    if marker.exists() and not force:
        done = json.loads(marker.read_text())
        if done.get("task") == task and done["settings"]["max_steps"] == steps and done["settings"]["seed"] == seed:
            print(f"using cached warm-up model {out} (greedy accuracy {done.get('greedy_accuracy')})")
            return done
    base = Path(tempfile.mkdtemp(prefix="tandem-tiny-"))
    init_tiny(base, seed=seed)
    kind = "code" if task == "code-agent" else task
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
    held_out = list(generate(kind, eval_n, seed=seed + 10_000))
    max_new = 96 if task == "math" else 48
    accuracy = _boxed_accuracy if task == "math" else _code_accuracy

    def evaluate(model):
        from transformers import AutoTokenizer
        return accuracy(model, AutoTokenizer.from_pretrained(base), held_out, chat_prompt_ids, max_new)

    def progress(p):
        print(f"sft {task}: step {p['step']}/{steps} loss {p['loss']:.3f} {p['tokens_per_s']:,.0f} tok/s "
              f"{p['elapsed_s']:.0f}s", flush=True)

    summary = train_sft(base, rows, out, settings, encode_prompt=chat_prompt_ids,
                        evaluate=evaluate if eval_n else None, progress=progress)
    summary["task"] = task
    write_json_atomic(marker, summary)    # a warm-up stopped mid-write is redone, not half-read
    shutil.rmtree(base, ignore_errors=True)
    print(f"warm-up done: {summary['steps']} steps, greedy accuracy {summary.get('greedy_accuracy')} "
          f"on {eval_n} held-out problems -> {out}")
    return summary


def cmd_sft(args) -> int:
    if args.task not in ("math", "code", "code-agent"):
        print(f"tandem sft: --task must be math, code or code-agent, got {args.task!r}", file=sys.stderr)
        return 2
    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.task]
    warm_up(args.task, Path(args.out), steps, args.seconds, args.seed, args.eval_n, args.force)
    return 0


def register(sub) -> None:
    p = sub.add_parser("sft", help="warm up the tiny model on solved synthetic tasks (cached)")
    p.add_argument("--task", required=True, help="math, code, or code-agent (with revision conversations)")
    p.add_argument("--out", required=True, help="output Hugging Face directory")
    # Steps, not seconds, so the cached model is the same on a busy machine as on an idle one.
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (batch 64); default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()))
    p.add_argument("--seconds", type=float, default=1800.0, help="time cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=200, help="held-out problems for the accuracy check")
    p.add_argument("--force", action="store_true", help="retrain even if a cached model matches")
    p.set_defaults(func=cmd_sft)
