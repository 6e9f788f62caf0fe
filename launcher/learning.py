"""Whether a run learned, and if not, why: said plainly, from the run's own records.

The trainer writes a `warning` record when the reward carries no signal or dynamic sampling
drops group after group, and a `run_stopped` record when its cap stops the run
(trainer/learning_signals.py). This module reads them back for the console, `summary.json`
and the report, and makes the run's last line on learning (`verdict`): the held-out accuracy
before and after with its noise, and, when it did not rise, the reasons the run's records and
its starting model give (a warm-up stopped before its steps, a starting policy that is almost
never right, the warnings it raised).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .warmup import describe, stopped_short

# Below this held-out accuracy a starting policy rarely has a right answer in a group to learn from.
RARELY_RIGHT = 0.10


def warnings_of(records: list[dict]) -> list[dict]:
    """The run's warnings, in order: `{kind, step, count, message}`."""
    return [{k: r.get(k) for k in ("kind", "step", "count", "message")}
            for r in records if r.get("event") == "warning" and r.get("message")]


def stopped_of(records: list[dict]) -> str | None:
    """Why the trainer stopped the run before its steps (the last `run_stopped` record), or None."""
    reasons = [r.get("reason") for r in records if r.get("event") == "run_stopped"]
    return reasons[-1] if reasons else None


def unfinished_warm_up(model_dir: str | Path) -> str | None:
    """A line when `model_dir` is a `tandem sft` warm-up stopped before its steps (its
    `sft.json` says so: earlier versions cached one their time cap stopped), else None."""
    try:
        done = json.loads((Path(model_dir) / "sft.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(done, dict) or not isinstance(done.get("steps"), int) or not stopped_short(done):
        return None   # not a `tandem sft` marker, or a finished warm-up
    return f"experiment.model {model_dir} is {describe(done)}; `tandem sft` with the same --out makes it again"


def verdict(summary: dict, records: list[dict], model_dir: str | Path | None = None) -> str | None:
    """One plain statement of what the run learned on the held-out problems, with the likely
    reasons when it did not; None when the run evaluated nothing."""
    ev = summary.get("eval") or {}
    before, after, n = ev.get("before"), ev.get("after"), ev.get("n") or 0
    if before is None or after is None or not n:
        return None
    change = 100 * (after - before)
    noise = 200 * math.sqrt((before * (1 - before) + after * (1 - after)) / n)   # 2 s.e. of the difference
    figures = f"{100 * before:.1f}% → {100 * after:.1f}% ({change:+.1f} points, n = {n}; two standard errors " \
              f"of the difference: {noise:.1f} points)"
    if change > noise:
        return f"held-out accuracy rose: {figures}"
    head = (f"held-out accuracy rose within noise: {figures}" if change > 0 else
            f"held-out accuracy did not rise: {figures}")
    why = []
    if model_dir is not None and (note := unfinished_warm_up(model_dir)):
        why.append(note)
    if before < RARELY_RIGHT:
        why.append(f"the starting policy was right on {100 * before:.1f}% of the held-out problems: groups whose "
                   f"samples are all wrong teach nothing, so RL needs a model that is right sometimes (a finished "
                   f"warm-up, `tandem sft`, or easier data)")
    kinds = {}
    for w in warnings_of(records):
        kinds[w["kind"]] = w["message"]
    why += [f"the run warned: {message}" for message in kinds.values()]
    if summary.get("stopped"):
        why.append(f"the run stopped early: {summary['stopped']}")
    if not why:
        why.append("the run's records name no cause: more steps, another learning rate (trainer.optim.lr) or "
                   "another seed may tell noise from a real loss")
    return head + ". Why: " + "; ".join(why) + "."
