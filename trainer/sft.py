"""Supervised warm-up: teach a model the answer format before RL.

RL from a model that is never right finds no group with a correct sample and learns nothing
(shared/BASELINES.md: below ~20% greedy accuracy the tiny model barely moves). A few minutes of
SFT on solved synthetic examples brings it into the range where RL has signal. The loss is on
the solution tokens only; the prompt goes through the tokenizer's chat template exactly as the
rollout workers will send it.

A warm-up is a number of steps, not of seconds, so its model is the same on a busy machine as
on an idle one. One stopped before its steps (a time cap, a stop request, a kill) writes no
model: its progress (weights, optimizer, schedule, the data order's random state) is saved as
a partial checkpoint every `checkpoint_every` steps and when it stops, and a later call given
that state continues from it to the same model an uninterrupted warm-up makes.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Settings that change how a warm-up runs, not the model it makes: a partial warm-up continues
# under other values of these.
HOW_IT_RUNS = ("seconds", "checkpoint_every")


@dataclass
class SFTSettings:
    # Seconds of training this call may spend before it stops and saves its progress; None = no cap.
    seconds: float | None = None
    max_steps: int = 100_000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    seed: int = 0
    # Steps between saves of the unfinished warm-up (a kill loses at most these); 0 = only on a stop.
    checkpoint_every: int = 100

    def identity(self) -> dict:
        """What makes the model: two warm-ups with the same identity make the same weights."""
        return {k: v for k, v in asdict(self).items() if k not in HOW_IT_RUNS}


def read_partial(path: str | Path, identity: dict) -> tuple[dict | None, str]:
    """The saved state of an unfinished warm-up at `path` if it was made with `identity`, and
    why not otherwise (`""` when there is none)."""
    path = Path(path)
    if not path.exists():
        return None, ""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # a file cut by a crash mid-write cannot be: it is written and renamed
        return None, f"{path} cannot be read ({type(e).__name__}: {e})"
    if state.get("identity") != identity:
        theirs = state.get("identity") or {}
        differs = ", ".join(f"{k} {theirs.get(k)!r} (now {v!r})" for k, v in identity.items() if theirs.get(k) != v)
        return None, f"{path} is an unfinished warm-up with other settings: {differs}"
    return state, ""


def _save_partial(path: Path, state: dict) -> None:
    """Written beside its name and renamed: a kill mid-write leaves the previous state whole. Its
    folder may not exist yet (`.cache/` of a fresh clone, before the first warm-up saved a model)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)


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
              progress: Callable[[dict], None] | None = None, partial: str | Path | None = None,
              resume: dict | None = None, identity: dict | None = None, stop: threading.Event | None = None,
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Fine-tune `model_dir` on rows `{prompt, solution}`; save a HF directory to `out_dir` atomically.

    `encode_prompt(tokenizer, text)` must be the rollout workers' prompt encoding, so the model
    is tuned on exactly the token sequences it will be asked to continue during RL.

    The summary's `complete` says whether it ran its `max_steps`. When it did not (`seconds`
    ran out on `clock`, or `stop` was set: `stopped_by` says which), `out_dir` is not written;
    the state is saved to `partial` (also every `checkpoint_every` steps, and once the steps are
    done, before the evaluation), and `resume=` that state (`read_partial`) continues from it.
    `identity` (default `settings.identity()`) is saved with it, so a different warm-up is never
    continued from it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    identity = identity if identity is not None else settings.identity()
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    examples = [encode_example(lambda t: encode_prompt(tok, t), tok, r["prompt"], r["solution"]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, settings.warmup_steps)))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    # A mixture-of-experts model adds its load-balancing loss (router_aux_loss_coef, transformers'
    # Switch loss over the unpadded tokens), which keeps the tokens spread over the experts: nothing
    # else stops a few of them from taking every token while the others never train.
    router = {"output_router_logits": True} if getattr(model.config, "router_aux_loss_coef", 0) else {}
    step, tokens, before_s, loss_value = 0, 0, 0.0, float("nan")
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        rng.setstate(_python_rng(resume["rng_python"]))
        torch.set_rng_state(resume["rng_torch"])
        step, tokens, before_s, loss_value = resume["step"], resume["tokens"], resume["seconds"], resume["loss"]
    t0 = clock()   # the one source of time: seconds, the cap, progress (tests play a busy machine)

    def save() -> None:
        if partial is not None:
            _save_partial(Path(partial), {
                "identity": identity, "step": step, "tokens": tokens, "loss": loss_value,
                "seconds": before_s + clock() - t0, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "rng_python": rng.getstate(), "rng_torch": torch.get_rng_state()})

    next_report, stopped_by = 0.0, None
    while step < settings.max_steps:
        elapsed = clock() - t0
        if stop is not None and stop.is_set():
            stopped_by = "a stop request"
            break
        if settings.seconds is not None and elapsed >= settings.seconds:
            stopped_by = f"its time cap ({settings.seconds:g} s)"
            break
        batch = rng.sample(examples, min(settings.batch_size, len(examples)))
        input_ids, labels, mask = _batch(batch, pad)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels, **router).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        tokens += int(mask.sum())
        loss_value = float(loss.detach())
        elapsed = clock() - t0
        if progress and elapsed >= next_report:
            progress({"step": step, "loss": loss_value, "elapsed_s": before_s + elapsed,
                      "tokens_per_s": tokens / max(before_s + elapsed, 1e-9)})
            next_report = elapsed + 10.0
        if not math.isfinite(loss_value):
            raise RuntimeError(f"SFT diverged at step {step} (loss {loss_value})")
        if settings.checkpoint_every and step % settings.checkpoint_every == 0 and step < settings.max_steps:
            save()
    seconds = before_s + clock() - t0
    summary = {"steps": step, "complete": stopped_by is None, "seconds": round(seconds, 1), "final_loss": loss_value,
               "tokens_per_s": round(tokens / max(seconds, 1e-9)), "settings": asdict(settings)}
    save()   # stopped: what the next call continues from; done: the evaluation may still be stopped
    if stopped_by is not None:
        return summary | {"stopped_by": stopped_by, "partial": str(partial) if partial is not None else None}
    model.eval()
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
    if partial is not None:
        Path(partial).unlink(missing_ok=True)
    return summary


def _python_rng(state):
    """random.Random's state as `setstate` takes it (a save turns its tuples into lists)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


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
