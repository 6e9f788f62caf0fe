"""Supervised warm-up: teach a model the answer format before RL.

RL from a model that is never right finds no group with a correct sample and learns nothing
(shared/BASELINES.md: below ~20% greedy accuracy the tiny model barely moves). A few minutes of
SFT on solved synthetic examples brings it into the range where RL has signal. The loss is on
the solution tokens only; the prompt goes through the tokenizer's chat template exactly as the
rollout workers will send it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class SFTSettings:
    seconds: float = 180.0
    max_steps: int = 100_000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    seed: int = 0


def encode_example(encode_prompt: Callable[[str], list[int]], tokenizer, prompt: str,
                   solution: str) -> tuple[list[int], int]:
    """(token ids, number of prompt tokens); the solution ends with EOS so the model learns to stop."""
    p = encode_prompt(prompt)
    s = tokenizer.encode(solution, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p + s, len(p)


def _batch(examples, pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt: len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def train_sft(model_dir: str | Path, rows: list[dict], out_dir: str | Path, settings: SFTSettings,
              encode_prompt: Callable[[object, str], list[int]],
              evaluate: Callable[[torch.nn.Module], float] | None = None,
              progress: Callable[[dict], None] | None = None) -> dict:
    """Fine-tune `model_dir` on rows `{prompt, solution}`; save a HF directory to `out_dir` atomically.

    `encode_prompt(tokenizer, text)` must be the rollout workers' prompt encoding, so the model
    is tuned on exactly the token sequences it will be asked to continue during RL.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    examples = [encode_example(lambda t: encode_prompt(tok, t), tok, r["prompt"], r["solution"]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, settings.warmup_steps)))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0, step, tokens = time.time(), 0, 0
    next_report = 0.0
    while step < settings.max_steps and time.time() - t0 < settings.seconds:
        batch = rng.sample(examples, min(settings.batch_size, len(examples)))
        input_ids, labels, mask = _batch(batch, pad)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        tokens += int(mask.sum())
        elapsed = time.time() - t0
        if progress and elapsed >= next_report:
            progress({"step": step, "loss": float(loss.detach()), "elapsed_s": elapsed,
                      "tokens_per_s": tokens / max(elapsed, 1e-9)})
            next_report = elapsed + 10.0
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"SFT diverged at step {step} (loss {float(loss)})")
    model.eval()
    summary = {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss": float(loss.detach()),
               "tokens_per_s": round(tokens / max(time.time() - t0, 1e-9)), "settings": asdict(settings)}
    if evaluate is not None:
        summary["greedy_accuracy"] = evaluate(model)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "sft.json").write_text(json.dumps(summary, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return summary


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], encode_prompt, max_new_tokens: int,
                       batch_size: int = 64) -> list[str]:
    """Greedy decoding in left-padded batches (for quick accuracy checks during warm-up)."""
    outs = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(0, len(prompts), batch_size):
        ids = [encode_prompt(tokenizer, p) for p in prompts[i: i + batch_size]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        outs += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
    return outs
