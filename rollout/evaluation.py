"""Greedy accuracy on held-out problems: the one measure behind `tandem eval`, the figures
before and after a run, and the held-out curve during it (`rollout.eval_every`).

The held-out problems never overlap training (a separate synthetic seed with training's texts
removed, or `rollout.eval_dataset`), and the same `n` problems are scored every time, so points
of the curve differ by the policy only.
"""
from __future__ import annotations

import asyncio
import math
import time

from tandem.services.protocol import GradeRequest

from .dataset import load_prompts

GRADE_BATCH = 64


def held_out_prompts(cfg, n: int):
    """Problems never drawn for training: a separate synthetic seed, or `rollout.eval_dataset`;
    asked with the system prompt and template training uses."""
    rc, task = cfg.rollout, cfg.reward.task
    asked = {"system_prompt": rc.system_prompt, "prompt_template": rc.prompt_template}
    if rc.eval_dataset:
        return load_prompts(rc.eval_dataset, task, n, cfg.experiment.seed, rc.eval_columns or rc.columns, **asked)[:n]
    train = {p.text for p in load_prompts(rc.dataset, task, rc.synthetic_size, cfg.experiment.seed, rc.columns)}
    pool = load_prompts(rc.dataset, task, 4 * n, cfg.experiment.seed + 10_000, rc.columns, **asked)
    return [p for p in pool if p.text not in train][:n]


def eval_record(result: dict, **extra) -> dict:
    """The `eval` record of metrics.jsonl for a result of `evaluate_prompts`: its x is the
    policy version that wrote the answers (the oldest, if several did)."""
    turns = {f"eval_{k}": result[k] for k in ("first_turn_accuracy", "first_turn_se", "turns_mean") if k in result}
    return {"event": "eval", "step": result["version"], "eval_accuracy": result["accuracy"],
            "eval_se": result["se"], "eval_n": result["n"], "eval_correct": result["correct"],
            "version_min": result["version"], "version_max": result["version_max"],
            "seconds": result["seconds"], **turns, **extra}


def standard_error(correct: int, n: int) -> float:
    """Of an accuracy measured on n problems (binomial): sqrt(p (1 - p) / n)."""
    if n <= 0:
        return 0.0
    p = correct / n
    return math.sqrt(p * (1 - p) / n)


async def evaluate_prompts(cfg, prompts, generator, reward, tokenizer=None, concurrency: int = 64,
                           deadline_s: float = 300.0) -> dict:
    """Greedy answers of the served policy to `prompts`, graded by the reward service.

    `generator` is a GenerationClient, `reward` a RequestClient of the reward service (whose
    timeout must exceed `deadline_s`, the grading time allowed per batch). The
    policy may change while the answers are generated (weights reach the servers mid-run):
    `version_min` and `version_max` are the oldest and newest policy versions that wrote any
    answer's tokens."""
    from transformers import AutoTokenizer

    from tandem.rollout.workflow import DEFAULT_WORKFLOW, chat_prompt_ids, grade_item

    tok = tokenizer or AutoTokenizer.from_pretrained(cfg.experiment.model)
    greedy = {"temperature": 0.0, "top_k": 1, "max_new_tokens": cfg.rollout.max_new_tokens}
    sem = asyncio.Semaphore(concurrency)
    t0 = time.time()
    if cfg.rollout.workflow != DEFAULT_WORKFLOW or cfg.rollout.agent:
        return await _evaluate_episodes(cfg, prompts, generator, reward, tok, greedy, sem, deadline_s)

    async def one(i, p):
        async with sem:
            res = await generator.generate(chat_prompt_ids(tok, p.messages()), greedy, f"eval/{i}")
            versions = list(res.output_versions or [0])
            return tok.decode(res.output_ids, skip_special_tokens=True), min(versions), max(versions)

    outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    verdicts = []
    for k in range(0, len(prompts), GRADE_BATCH):
        items = [grade_item(p, o[0]) for p, o in zip(prompts[k:k + GRADE_BATCH], outs[k:k + GRADE_BATCH], strict=True)]
        verdicts += (await reward.request(GradeRequest(items=items, deadline_s=deadline_s))).verdicts
    correct = sum(v.correct for v in verdicts)
    return {"accuracy": correct / max(1, len(prompts)), "n": len(prompts), "correct": correct,
            "se": round(standard_error(correct, len(prompts)), 4),
            "version": min((o[1] for o in outs), default=0), "version_max": max((o[2] for o in outs), default=0),
            "seconds": round(time.time() - t0, 1)}


async def _evaluate_episodes(cfg, prompts, generator, reward, tok, greedy: dict, sem, deadline_s: float) -> dict:
    """A custom (e.g. multi-turn) workflow scored as it trains: one greedy episode per problem,
    correct when the workflow's own verdict says so. Workflows and agents that record
    `first_turn_correct` (the code environments) also get the pass rate of their first turn, on the
    same problems; every one gets its model turns per episode (`turns_mean`)."""
    from tandem.rollout.agent import episode_function
    from tandem.rollout.workflow import EpisodeContext
    from tandem.services.protocol import Ticket

    rc, t0 = cfg.rollout, time.time()
    workflow = episode_function(cfg)

    async def grade(items):
        return (await reward.request(GradeRequest(items=items, deadline_s=deadline_s))).verdicts

    ctx = EpisodeContext(generate=generator.generate, grade=grade, tokenizer=tok, n_samples=1,
                         sampling_params=greedy, max_turns=rc.max_turns, turn_discount=rc.turn_discount,
                         feedback_chars=rc.feedback_chars)

    async def one(i, p):
        async with sem:
            return (await workflow(ctx, p, Ticket(group_id=f"eval/{i}", admit_version=0)))[0]

    samples = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    n = len(prompts)
    correct = int(sum(t.timings.get("correct", 0.0) for t in samples))
    first = int(sum(t.timings.get("first_turn_correct", t.timings.get("correct", 0.0)) for t in samples))
    # Episodes that grade their first turn say so (the code environments); an agent that grades
    # only its end (a tool-using agent) has no first-turn figure to report.
    graded_first = any("first_turn_correct" in t.timings for t in samples)
    versions = [(int(t.output_versions.min()), int(t.output_versions.max())) for t in samples if len(t.output_versions)]
    return {"accuracy": correct / max(1, n), "n": n, "correct": correct,
            "se": round(standard_error(correct, n), 4),
            **({"first_turn_accuracy": first / max(1, n), "first_turn_se": round(standard_error(first, n), 4)}
               if graded_first else {}),
            "turns_mean": sum(t.timings.get("turns", 1.0) for t in samples) / max(1, n),
            "version": min((v[0] for v in versions), default=0), "version_max": max((v[1] for v in versions), default=0),
            "seconds": round(time.time() - t0, 1)}
