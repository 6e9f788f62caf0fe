"""A run's metrics.jsonl and eval files written directly (no processes): what the report,
trackers and summaries read, shaped like a real run's records (trainer steps, rollout groups,
controller weight syncs, in-run held-out evaluations)."""
from __future__ import annotations

import json

from tandem.services.protocol import ExpDir


def write_synthetic_run(exp: ExpDir, n_steps: int = 60, step_s: float = 2.0, eval_every: int = 10) -> None:
    exp.root.mkdir(parents=True, exist_ok=True)
    t0, records = 1_000_000.0, []
    for s in range(1, n_steps + 1):
        t = t0 + s * step_s
        records.append({"time": t, "role": "trainer", "rank": 0, "event": "step", "step": s,
                        "reward_mean": -0.2 + 0.8 * s / n_steps + (0.3 if s % 2 else -0.3),
                        "tokens_per_s": 1000 + 10 * s, "step_s": step_s, "wait_s": 0.2, "prox_s": 0.3,
                        "train_s": 1.0, "weight_sync_s": 0.4, "n_seqs": 16,
                        "staleness_hist_total": {"0": 4 * s, "1": 3 * s, "2": s},
                        "mismatch_k3": 1e-9 * s, "mismatch_ratio_max": 1.001, "mismatch_ratio_mean": 1.0,
                        "dynamic_filtered_groups": s % 3})
        records.append({"time": t + 0.5, "role": "controller", "rank": 0, "event": "weight_sync", "version": s,
                        "seconds": 0.4, "phases": {"publish": 0.1, "load": 0.3}})
        for g in range(4):
            records.append({"time": t + 0.3 * g, "role": "rollout", "rank": g % 2, "event": "group",
                            "seconds": 3.0, "correct": min(1.0, 0.3 + 0.5 * s / n_steps), "reward_mean": 0.0})
        if eval_every and s % eval_every == 0 and s < n_steps:
            records.append({"time": t + 1, "role": "rollout", "rank": 0, "event": "eval", "step": s,
                            "eval_accuracy": 0.3 + 0.4 * s / n_steps, "eval_se": 0.02, "eval_n": 500})
    exp.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    (exp.root / "eval-before.json").write_text(json.dumps({"accuracy": 0.3, "n": 500, "correct": 150}))
    (exp.root / "eval-after.json").write_text(json.dumps({"accuracy": 0.7, "n": 500, "correct": 350, "se": 0.0205}))
    (exp.root / "summary.json").write_text(json.dumps({"steps": n_steps, "wall_s": n_steps * step_s,
                                                       "eval": {"before": 0.3, "after": 0.7},
                                                       "throughput": {"trajectories_per_s": 8.0},
                                                       "weight_sync": {"mean_s": 0.4}}))
