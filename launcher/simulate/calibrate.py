"""Fit the cost model to what a real run measured (`tandem simulate --calibrate EXP_DIR`).

Datasheet rooflines get the shape right but not the constants (kernel efficiency, scheduler
overhead, the filesystem). A run's `<exp>/metrics.jsonl` holds the constants; this module reads
them by metric name, whatever role logged them:

| metric | meaning | used for |
|---|---|---|
| `gen_tokens_per_s` + `gen_running` | decode tokens/s of ONE server over a window, and the mean number of requests it ran concurrently | decode step time vs batch size |
| `gen_context_tokens` (optional) | mean total tokens held in that server's KV cache over the window | decode cost per context token |
| `gen_prefill_tokens_per_s` (optional) | prefill throughput of one server | prefill / re-prefill cost |
| `train_tokens` + `train_step_s` | tokens trained in one global step, and the step's compute seconds (not waiting for data) | trainer step time vs tokens |
| `train_world_size` (optional) | trainer GPUs (ranks) of that run | scaling the fit to another layout |
| `weight_publish_s`, `weight_load_s` (or `weight_sync_s`) | trainer busy publishing one version; one server paused loading it | weight-sync costs |
| `output_tokens` | one record per finished trajectory | `simulate.output_lengths: empirical:EXP_DIR` |

Each fit is an ordinary least-squares line (numpy), clipped at zero; a metric that is missing
falls back to a stated default (listed in `Calibration.notes`), never silently.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from launcher.config import ConfigError
from launcher.simulate.costs import Costs, Layout


def read_records(path: str | Path) -> list[dict]:
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    try:
        lines = f.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--calibrate: cannot read {f}: {e}") from None
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares y ~ x @ coef with coef >= 0 (drop negative terms and refit)."""
    cols = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            full = np.zeros(x.shape[1])
            full[cols] = np.maximum(coef, 0)
            return full
        cols.pop(int(np.argmin(coef)))


def _num(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


@dataclass
class Calibration:
    source: str
    # Decode step seconds = d0 + d1 * running + d2 * context tokens.
    d0: float
    d1: float
    d2: float
    # Train step seconds = t0 + t1 * tokens, measured on train_world ranks.
    t0: float
    t1: float
    train_world: int
    prefill_per_token: float
    publish_s: float
    load_s: float
    samples: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def costs(self, layout: Layout, max_running: int, kv_capacity: float = math.inf) -> Costs:
        # Trainer compute scales with its GPU count; fixed costs do not.
        scale = self.train_world / max(1, layout.train_gpus)
        return Costs(decode_fixed=[0.0] + [self.d0 + self.d1 * n for n in range(1, max_running + 1)],
                     decode_per_ctx=self.d2, kv_capacity=kv_capacity, max_running=max_running,
                     train_fixed=self.t0, train_per_token=max(self.t1 * scale, 1e-15), train_per_sq=0.0,
                     prefill_per_token=self.prefill_per_token, prefill_per_sq=0.0,
                     publish_s=self.publish_s, load_s=self.load_s, notes=list(self.notes))


def calibrate(exp_dir: str | Path) -> Calibration:
    recs = read_records(exp_dir)
    notes: list[str] = []
    gen = [(r, _num(r, "gen_tokens_per_s"), _num(r, "gen_running")) for r in recs]
    gen = [(r, tps, n) for r, tps, n in gen if tps and n and tps > 0 and n > 0]
    if not gen:
        raise ConfigError(f"--calibrate {exp_dir}: no record with gen_tokens_per_s and gen_running "
                          f"(one per generation server and window); see docs/simulator.md")
    step = np.array([n / tps for _, tps, n in gen])
    running = np.array([n for _, _, n in gen])
    ctx = [_num(r, "gen_context_tokens") for r, _, _ in gen]
    if all(c is not None for c in ctx) and len(set(ctx)) > 2:
        d0, d1, d2 = _fit(np.column_stack([np.ones_like(step), running, np.array(ctx)]), step)
    elif len(set(running.tolist())) > 1:
        (d0, d1), d2 = _fit(np.column_stack([np.ones_like(step), running]), step), 0.0
        notes.append("no gen_context_tokens: decode cost does not grow with context")
    else:
        d0, d1, d2 = float(step.mean()), 0.0, 0.0
        notes.append("one concurrency level only: decode step time taken as constant")
    train = [(_num(r, "train_tokens"), _num(r, "train_step_s")) for r in recs]
    train = [(x, y) for x, y in train if x and y and x > 0 and y > 0]
    if not train:
        raise ConfigError(f"--calibrate {exp_dir}: no record with train_tokens and train_step_s "
                          f"(one per trainer step); see docs/simulator.md")
    tx = np.array([x for x, _ in train])
    ty = np.array([y for _, y in train])
    if len(set(tx.tolist())) > 1:
        t0, t1 = _fit(np.column_stack([np.ones_like(tx), tx]), ty)
    else:
        t0, t1 = 0.0, float((ty / tx).mean())
        notes.append("one batch size only: trainer time taken as proportional to tokens")
    if t1 <= 0:
        t1 = float((ty / tx).mean())
    worlds = [_num(r, "train_world_size") for r in recs if _num(r, "train_world_size")]
    world = int(worlds[-1]) if worlds else 1
    if not worlds:
        notes.append("no train_world_size: assuming the run trained on 1 rank")
    pre = [_num(r, "gen_prefill_tokens_per_s") for r in recs if _num(r, "gen_prefill_tokens_per_s")]
    if pre:
        prefill = 1.0 / float(np.median(pre))
    else:
        # A prefilled token costs about what one more sequence in a decode step costs.
        prefill = d1
        notes.append("no gen_prefill_tokens_per_s: prefill priced at the marginal decode cost per request")
    sync = [_num(r, "weight_sync_s") for r in recs if _num(r, "weight_sync_s") is not None]
    pub = [_num(r, "weight_publish_s") for r in recs if _num(r, "weight_publish_s") is not None]
    load = [_num(r, "weight_load_s") for r in recs if _num(r, "weight_load_s") is not None]
    pub = pub or sync
    load = load or sync
    if not pub or not load:
        notes.append("no weight_publish_s/weight_load_s/weight_sync_s: weight sync taken as free")
    return Calibration(source=str(exp_dir), d0=float(d0), d1=float(d1), d2=float(d2), t0=float(t0),
                       t1=float(t1), train_world=world, prefill_per_token=float(prefill),
                       publish_s=float(np.median(pub)) if pub else 0.0,
                       load_s=float(np.median(load)) if load else 0.0,
                       samples={"gen windows": len(gen), "trainer steps": len(train),
                                "weight syncs": max(len(pub), len(load))},
                       notes=notes)
