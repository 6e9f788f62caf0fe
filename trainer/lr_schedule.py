"""The learning rate of every optimizer update: a warm-up, then constant, linear or cosine decay.

One function for both backends: the torch backend runs it as a `LambdaLR`, the Megatron backend
sets each update's rate from it (trainer/megatron/backend.py). Both count *applied* optimizer
updates (a skipped update does not advance the schedule), and both checkpoint that count (the
torch scheduler's `last_epoch`, the Megatron backend's `updates`), so a resumed run continues the
schedule where it stopped: nothing but the count is state.

Update k (0-based) of a run of T updates (`trainer.optim.decay_steps`, default `total_steps x
ppo_n_minibatches`, the run's updates), W = `warmup_steps`, m = `min_lr_ratio`:

    k < W:    lr * (k + 1) / W                               (the warm-up the trainer always had)
    k >= W:   lr * (m + (1 - m) * d(p)),  p = min(1, (k - W) / max(1, T - W))
              d(p) = 1 (constant), 1 - p (linear), (1 + cos(pi p)) / 2 (cosine)

The decay is transformers' `get_linear_schedule_with_warmup` / `get_cosine_with_min_lr_schedule_
with_warmup` progress (p = 0 at the first update after the warm-up, 1 at update T, held there);
the warm-up keeps this trainer's own `(k + 1) / W`, so that `constant` is the schedule every run
before had, number for number.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def decay_updates(tcfg) -> int:
    """T: the updates the decay spans (`optim.decay_steps`, else every update of the run)."""
    o = tcfg.optim
    return o.decay_steps or tcfg.total_steps * tcfg.ppo_n_minibatches


def lr_factor(optim, update: int, total: int) -> float:
    """The multiplier of `optim.lr` for update `update` (0-based) of a decay over `total` updates."""
    warm = optim.warmup_steps
    if update < warm or optim.schedule == "constant":
        return min(1.0, (update + 1) / max(1, warm))
    p = min(1.0, (update - warm) / max(1, total - warm))
    shape = 1.0 - p if optim.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape


def schedule_problems(optim) -> list[tuple[str, str]]:
    """(key under trainer.optim, message) for settings that cannot work or would do nothing."""
    out = []
    if optim.schedule not in SCHEDULES:
        out.append(("schedule", f"must be one of {', '.join(SCHEDULES)}, got {optim.schedule!r}"))
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        out.append(("min_lr_ratio", f"must be in [0, 1], got {optim.min_lr_ratio}"))
    elif optim.schedule == "constant" and optim.min_lr_ratio != 0.0:
        out.append(("min_lr_ratio", f"{optim.min_lr_ratio} has no effect with trainer.optim.schedule: constant "
                                    f"(set schedule: linear or cosine)"))
    if optim.decay_steps < 0:
        out.append(("decay_steps", "must be >= 0 (0 = the run's optimizer updates)"))
    elif optim.decay_steps and optim.decay_steps <= optim.warmup_steps:
        out.append(("decay_steps", f"{optim.decay_steps} must be larger than trainer.optim.warmup_steps="
                                   f"{optim.warmup_steps}: the decay starts after the warm-up"))
    elif optim.decay_steps and optim.schedule == "constant":
        out.append(("decay_steps", "has no effect with trainer.optim.schedule: constant"))
    return out
