"""Progress lines while a run goes, and `<exp>/summary.json` when it ends.

Both read only `<exp>/metrics.jsonl`, the stream every role appends to, so they work the same
for a local run, a cluster run, or a finished run read afterwards.
"""
from __future__ import annotations

import json
import time
from collections import Counter

from services.protocol import ExpDir, read_metrics, write_json_atomic


class Progress:
    """Prints one line per trained step: step, reward, accuracy, staleness, tokens/s, ETA."""

    def __init__(self, exp: ExpDir, total_steps: int, resume: bool = False):
        self.exp, self.total = exp, total_steps
        # A resumed run prints its own steps only, not the earlier launches' again.
        self.offset = _size(exp.metrics) if resume else 0
        self.t0 = time.time()
        self.first_step_at: float | None = None
        self.steps_seen = 0
        self.correct: list[float] = []  # per-group accuracy of groups finished since the last step

    def _new_records(self) -> list[dict]:
        try:
            with open(self.exp.metrics, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # leave a half-written last line for the next read
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def update(self) -> None:
        for rec in self._new_records():
            if rec.get("role") == "rollout" and rec.get("event") == "group":
                self.correct.append(rec.get("correct", 0.0))
                continue
            if rec.get("role") != "trainer" or rec.get("event") != "step":
                continue
            accuracy = sum(self.correct) / len(self.correct) if self.correct else float("nan")
            self.correct = []
            staleness = max((int(k) for k in rec.get("staleness_hist") or {}), default=0)
            now = time.time()
            self.first_step_at = self.first_step_at or now
            self.steps_seen += 1
            step = rec.get("step", self.steps_seen)
            rate = (now - self.first_step_at) / max(1, self.steps_seen - 1) if self.steps_seen > 1 else None
            eta = f"{rate * (self.total - step) / 60:.1f} min" if rate else "?"
            print(f"step {step}/{self.total} | reward {rec.get('reward_mean', float('nan')):+.2f} | "
                  f"sample accuracy {100 * accuracy:.0f}% | staleness max {staleness} | "
                  f"{rec.get('tokens_per_s', 0):,.0f} tok/s | ETA {eta}", flush=True)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def run_steps(records: list[dict]) -> list[dict]:
    """The trainer's step records of the run as it stands: when a resumed trainer trains a step
    number again (it went back to its last checkpoint), the earlier launch's records from that
    step on were an abandoned future and are dropped, so every step counts once."""
    steps: list[dict] = []
    for rec in records:
        if rec.get("event") != "step":
            continue
        step = rec.get("step")
        if step is not None:
            while steps and steps[-1].get("step") is not None and steps[-1]["step"] >= step:
                steps.pop()
        steps.append(rec)
    return steps


def run_staleness(steps: list[dict]) -> Counter:
    """Trained groups by staleness over the whole run. The trainer's `staleness_hist_total` is
    cumulative (it survives a resume), so the last step record holds the run's histogram."""
    return Counter({int(k): int(v) for k, v in (steps[-1].get("staleness_hist_total") or {}).items()}) \
        if steps else Counter()


def summarize(exp: ExpDir, evals: dict, wall_s: float) -> dict:
    """Aggregate the run's metrics into `<exp>/summary.json` (the figures users compare runs by)."""
    steps = run_steps(read_metrics(exp, "trainer"))
    hist = run_staleness(steps)
    trained_trajs = sum(r.get("n_seqs", 0) for r in steps)
    trained_tokens = sum(r.get("train_tokens", 0) for r in steps)
    sync = [r["weight_sync_s"] for r in steps if "weight_sync_s" in r]
    step_s = [r["step_s"] for r in steps if "step_s" in r]
    first = steps[0]["time"] if steps else None
    span = (steps[-1]["time"] - first) if len(steps) > 1 else None
    before, after = evals.get("before"), evals.get("after")
    summary = {
        "steps": len(steps),
        "eval": {"before": before and before["accuracy"], "after": after and after["accuracy"],
                 "n": (after or before or {}).get("n", 0),
                 # multi-turn workflows: the pass rate of the first turn, before feedback
                 **({"first_turn_before": before and before.get("first_turn_accuracy"),
                     "first_turn_after": after and after.get("first_turn_accuracy")}
                    if "first_turn_accuracy" in (after or before or {}) else {})},
        "staleness": {"max": max(hist) if hist else None, "histogram": {str(k): hist[k] for k in sorted(hist)},
                      # groups the trainer dropped as staler than eta (cumulative, like the histogram)
                      "dropped": int(steps[-1].get("buffer_dropped_stale", 0)) if steps else 0},
        "throughput": {"trajectories_per_s": trained_trajs / span if span else None,
                       "tokens_per_s": trained_tokens / span if span else None},
        "weight_sync": {"mean_s": sum(sync) / len(sync) if sync else None,
                        "fraction_of_step": (sum(sync) / sum(step_s)) if sync and step_s and sum(step_s) else None},
        "wall_s": round(wall_s, 1),
        # seconds of RL: from the start of the first training step to the end of the last
        "rl_s": round(steps[-1]["time"] - first + steps[0].get("step_s", 0.0), 1) if steps else None,
    }
    write_json_atomic(exp.root / "summary.json", summary)
    return summary
