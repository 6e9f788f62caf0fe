"""Progress lines while a run goes, and `<exp>/summary.json` when it ends.

Both read only `<exp>/metrics.jsonl`, the stream every role appends to, so they work the same
for a local run, a cluster run, or a finished run read afterwards.
"""
from __future__ import annotations

import json
import time
from collections import Counter

from tandem.services.protocol import ExpDir, MetricsWriter, read_metrics, write_json_atomic

from .learning import stopped_of, verdict, warnings_of

RESUMED = "resumed"


def mark_resumed(exp: ExpDir) -> dict:
    """Record in `<exp>/metrics.jsonl` that a launch resumes the run here: `{"event": "resumed",
    "role": "launcher", "resumed_at": <time>, "last_step": <the highest step trained before>}`.

    It is the run's one boundary between launches in its own stream: the summary's throughput
    and the progress lines count only the records after the last one (the gap between launches
    is no one's work), and the report draws the resumed-at mark at `resumed_at`."""
    steps = [r.get("step") for r in read_metrics(exp, "trainer", "step") if r.get("step") is not None]
    writer = MetricsWriter(exp, "launcher")
    record = {"event": RESUMED, "resumed_at": time.time(), "last_step": max(steps, default=0)}
    writer.log(**record)
    writer.close()
    return record


class Progress:
    """Prints one line per trained step: step, reward, accuracy, staleness, tokens/s, ETA; and
    each warning the trainer records (no reward signal, groups dropped in a row: trainer/
    learning_signals.py) where it falls between them.

    The accuracy is that of the samples the step trained (its `group_ids`, looked up in the
    rollout workers' `group` records), the same samples as its reward. After a resume the first
    steps train groups the earlier launch generated (the trainer's checkpoint holds them): their
    records are read from the earlier part of the stream, so the line never says `nan%`; a step
    none of whose groups has a record says `-`."""

    def __init__(self, exp: ExpDir, total_steps: int, resume: bool = False):
        self.exp, self.total = exp, total_steps
        self.offset = 0
        # group id -> fraction of its samples that were correct, until a step trains it
        self.correct: dict[str, float] = {}
        self.step = 0   # the trainer's last step recorded (an earlier launch's, until this one trains)
        if resume:
            # A resumed run prints its own steps only, not the earlier launches' again; it reads
            # their groups, which its first steps may train.
            for rec in self._new_records():
                if not self._note_group(rec) and rec.get("role") == "trainer" and rec.get("event") == "step":
                    self.step = rec.get("step", self.step)
        self.t0 = time.time()
        self.first_step_at: float | None = None
        self.steps_seen = 0

    def _new_records(self) -> list[dict]:
        try:
            with open(self.exp.metrics, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # leave a half-written last line for the next read
        self.offset += end
        return _parse(data[:end])

    def _note_group(self, rec: dict) -> bool:
        if rec.get("role") == "rollout" and rec.get("event") == "group" and "group_id" in rec:
            self.correct[rec["group_id"]] = rec.get("correct", 0.0)
            return True
        return False

    def _accuracy(self, rec: dict) -> str:
        found = [self.correct.pop(g) for g in rec.get("group_ids") or () if g in self.correct]
        return f"{100 * sum(found) / len(found):.0f}%" if found else "-"

    def update(self) -> None:
        records = self._new_records()
        # Groups first: a group's record may land just after the step that trained it.
        shown = [rec for rec in records if not self._note_group(rec) and rec.get("role") == "trainer"
                 and rec.get("event") in ("step", "warning")]
        for rec in shown:
            if rec["event"] == "warning":
                print(f"warning: {rec.get('message')}", flush=True)
                continue
            staleness = max((int(k) for k in rec.get("staleness_hist") or {}), default=0)
            now = time.time()
            self.first_step_at = self.first_step_at or now
            self.steps_seen += 1
            step = self.step = rec.get("step", self.steps_seen)
            rate = (now - self.first_step_at) / max(1, self.steps_seen - 1) if self.steps_seen > 1 else None
            eta = f"{rate * (self.total - step) / 60:.1f} min" if rate else "?"
            print(f"step {step}/{self.total} | reward {rec.get('reward_mean', float('nan')):+.2f} | "
                  f"sample accuracy {self._accuracy(rec)} | staleness max {staleness} | "
                  f"{rec.get('tokens_per_s', 0):,.0f} tok/s | ETA {eta}", flush=True)


def _parse(data: bytes) -> list[dict]:
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


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


def this_launch(records: list[dict]) -> list[dict]:
    """The records after the last `resumed` mark (all of them for a run never resumed)."""
    marks = [i for i, r in enumerate(records) if r.get("event") == RESUMED]
    return records[marks[-1] + 1:] if marks else records


def _throughput(steps: list[dict]) -> tuple[float | None, float | None]:
    """(trajectories/s, tokens/s) over consecutive step records: from the first step's end to the
    last's (one step: its own seconds)."""
    if not steps:
        return None, None
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else steps[0].get("step_s")
    if not span:
        return None, None
    return (sum(r.get("n_seqs", 0) for r in steps) / span, sum(r.get("train_tokens", 0) for r in steps) / span)


def summarize(exp: ExpDir, evals: dict, wall_s: float, model: str | None = None) -> dict:
    """Aggregate the run's metrics into `<exp>/summary.json` (the figures users compare runs by).

    Steps, staleness and evaluation are the run's (every launch, each step once); throughput and
    `rl_s` are this launch's (after its `resumed` mark): the time between launches is no one's
    work, and counted in it would halve a resumed run's throughput. `warnings` are the run's,
    `stopped` is why this launch's trainer stopped before its steps (null: it did not), and
    `verdict` says whether held-out accuracy rose and, if not, why (`learning.py`; `model`: the
    run's experiment.model, whose warm-up record it reads)."""
    records = read_metrics(exp)
    steps = run_steps([r for r in records if r.get("role") == "trainer"])
    now = run_steps([r for r in this_launch(records) if r.get("role") == "trainer"])
    hist = run_staleness(steps)
    sync = [r["weight_sync_s"] for r in steps if "weight_sync_s" in r]
    step_s = [r["step_s"] for r in steps if "step_s" in r]
    trajs_s, tokens_s = _throughput(now)
    before, after = evals.get("before"), evals.get("after")
    summary = {
        "steps": len(steps),
        "eval": {"before": before and before["accuracy"], "after": after and after["accuracy"],
                 "n": (after or before or {}).get("n", 0),
                 # multi-turn workflows: the pass rate of the first turn, before feedback
                 **({"first_turn_before": before and before.get("first_turn_accuracy"),
                     "first_turn_after": after and after.get("first_turn_accuracy")}
                    if "first_turn_accuracy" in (after or before or {}) else {}),
                 # multi-turn workflows and agents: model turns per episode (an agent's tool use)
                 **({"turns_before": before and before.get("turns_mean"), "turns_after": after and after.get("turns_mean")}
                    if "turns_mean" in (after or before or {}) else {})},
        "staleness": {"max": max(hist) if hist else None, "histogram": {str(k): hist[k] for k in sorted(hist)},
                      # groups the trainer dropped as staler than eta (cumulative, like the histogram)
                      "dropped": int(steps[-1].get("buffer_dropped_stale", 0)) if steps else 0},
        # this launch's steps (`steps`: how many; fewer than the run's after a resume)
        "throughput": {"trajectories_per_s": trajs_s, "tokens_per_s": tokens_s, "steps": len(now)},
        "weight_sync": {"mean_s": sum(sync) / len(sync) if sync else None,
                        "fraction_of_step": (sum(sync) / sum(step_s)) if sync and step_s and sum(step_s) else None},
        "wall_s": round(wall_s, 1),
        # seconds of RL in this launch: from the start of its first training step to the end of its last
        "rl_s": round(now[-1]["time"] - now[0]["time"] + now[0].get("step_s", 0.0), 1) if now else None,
        "warnings": warnings_of(records),
        "stopped": stopped_of(this_launch(records)),
    }
    summary["verdict"] = verdict(summary, records, model)
    write_json_atomic(exp.root / "summary.json", summary)
    return summary
