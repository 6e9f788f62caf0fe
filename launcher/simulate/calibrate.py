"""Fit the cost model to what a real run measured (`tandem simulate --calibrate EXP_DIR`).

Datasheet rooflines get the shape right but not the constants (kernel efficiency, scheduler
overhead, the filesystem). A run's `<exp>/metrics.jsonl` holds the constants; this module reads
them by metric name, whatever role logged them (docs/simulator.md lists who logs what):

| metric | meaning | used for |
|---|---|---|
| `gen_decode_s` + `gen_steps` + `gen_running` | ONE server's seconds in decode steps over a window, the steps, and their mean batch | decode step time vs batch size |
| `gen_context_tokens` | mean tokens held in that server's KV cache per decode step | decode cost per context token |
| `gen_decode_moments` | sums over that window's decode steps of products of forward passes, rows, padded KV entries and seconds (embedded server) | the decode fit over every step: per pass, per row, per padded entry (preferred when present) |
| `gen_prefill_s` + `gen_prefills` + `gen_prefill_tokens` | that server's seconds in prefill calls, the calls, their tokens | prefill / re-prefill cost |
| `train_tokens` + `train_step_s` | tokens trained in one global step, and its seconds without waiting for data or weights | trainer step time vs tokens |
| `train_world_size` | trainer ranks of that run | scaling the fit to another layout |
| `weight_publish_s` | trainer busy publishing one version | weight-sync cost on the trainer |
| `gen_paused_s`, else `weight_load_s` | one server stopped by a weight update (pause to continue), or just its load | weight-sync cost on a server |
| `checkpoint_s` | the trainer saving a checkpoint | checkpoint cost |
| `gen_overhead_s` + `gen_requests` | that server's busy time outside forward passes, and the requests it took | per-request handling cost |
| `output_tokens` | per finished trajectory (a list per group record) | `simulate.output_lengths: empirical:EXP_DIR` |

Servers without decode timings (e.g. SGLang's scraped `gen_tokens_per_s` + `gen_running`)
still calibrate: the step time is then `gen_running / gen_tokens_per_s`. Each fit is an ordinary
least-squares line (numpy) with coefficients kept >= 0; a missing metric falls back to a stated
default (listed in `Calibration.notes`), never silently.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.launcher.config import ConfigError
from tandem.launcher.simulate.costs import Costs, Layout

# Windows whose prefill calls average within this factor of each other in tokens per call cannot
# separate a per-call cost from a per-token one (_prefill_costs).
SAME_LENGTH_SPREAD = 1.5


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


def _fit_moments(recs: list[dict]) -> tuple[float, float, float, int] | None:
    """(d0 per forward pass, d1 per row, d2 per padded KV entry, steps) fitted over every decode
    step, from the windows' pooled `gen_decode_moments` (the normal equations), coefficients
    kept >= 0."""
    pooled: dict[str, float] = {}
    for r in recs:
        m = r.get("gen_decode_moments")
        if isinstance(m, dict):
            for k, v in m.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    pooled[k] = pooled.get(k, 0.0) + v
    names = ("f", "n", "p")
    products = [a + b for a in names for b in names if a <= b]
    if pooled.get("1", 0) < 10 or not all(k in pooled for k in (*names, *products, "tf", "tn", "tp")):
        return None
    gram = np.array([[pooled[min(a, b) + max(a, b)] for b in names] for a in names])
    rhs = np.array([pooled["tf"], pooled["tn"], pooled["tp"]])
    cols = [0, 1, 2]
    while True:
        coef = np.linalg.lstsq(gram[np.ix_(cols, cols)], rhs[cols], rcond=None)[0]
        if (coef >= 0).all() or len(cols) == 1:
            full = np.zeros(3)
            full[cols] = np.maximum(coef, 0)
            return float(full[0]), float(full[1]), float(full[2]), int(pooled["1"])
        cols.pop(int(np.argmin(coef)))


def _num(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _values(recs: list[dict], key: str) -> list[float]:
    return [v for r in recs if (v := _num(r, key)) is not None]


def _decode_step_s(rec: dict) -> float | None:
    """Mean seconds of one decode step in a server window."""
    decode_s, steps = _num(rec, "gen_decode_s"), _num(rec, "gen_steps")
    if decode_s and steps:
        return decode_s / steps
    tps, n = _num(rec, "gen_tokens_per_s"), _num(rec, "gen_running")
    return n / tps if tps and n else None


def _prefill_costs(recs: list[dict], marginal_decode: float, one_pass: float,
                   notes: list[str]) -> tuple[float, float]:
    """(seconds per prefill call, seconds per prefilled token) from the servers' windows."""
    rows = [(_num(r, "gen_prefill_s"), _num(r, "gen_prefills"), _num(r, "gen_prefill_tokens")) for r in recs]
    rows = [(s, c, t) for s, c, t in rows if s and c and t and s > 0]
    per_call = [t / c for _, c, t in rows]
    if rows and max(per_call) < SAME_LENGTH_SPREAD * min(per_call):
        # Every call prefilled about as many tokens (a synchronous run prefills its prompts and
        # nothing else): calls and tokens move together, so a fit splits the cost between them
        # at random, and a re-prefill of prompt + output (retract, abort, interrupted requests)
        # is priced from that accident. A call costs up to a forward pass's fixed part (one row
        # of a decode step), a token at most what one more row of a decode step costs (the
        # decode fit's d0 moves between runs; this bound keeps a long re-prefill from following
        # it), and a call of the run's length what it measured.
        calls, tokens = sum(c for _, c, _ in rows), sum(t for _, _, t in rows)
        mean_call = sum(s for s, _, _ in rows) / calls
        per_token = min((mean_call - min(mean_call, one_pass)) * calls / tokens, marginal_decode)
        call = mean_call - per_token * tokens / calls
        notes.append(f"prefill calls all of about {tokens / calls:.0f} tokens: priced {1e3 * call:.2f} ms per call "
                     f"+ {1e6 * per_token:.1f} us per token (the split cannot be fitted)")
        return call, per_token
    if len(rows) >= 3:
        secs = np.array([s for s, _, _ in rows])
        call, tok = _fit(np.array([[c, t] for _, c, t in rows]), secs)
        if tok > 0 or call > 0:
            return float(call), float(tok)
    if rows:  # too few windows (or too alike) for two terms: the mean cost per prefilled token
        return 0.0, sum(s for s, _, _ in rows) / sum(t for _, _, t in rows)
    rates = _values(recs, "gen_prefill_tokens_per_s")
    if rates:
        return 0.0, 1.0 / float(np.median(rates))
    # A prefilled token costs about what one more sequence in a decode step costs.
    notes.append("no prefill timings: prefill priced at the marginal decode cost per request")
    return 0.0, marginal_decode


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
    prefill_per_request: float = 0.0
    checkpoint_s: float = 0.0
    request_s: float = 0.0
    # d2 is per padded KV entry (rows x the longest row; an embedded server's windows carry
    # gen_decode_moments) rather than per token held (SGLang's paged cache, window means).
    decode_padded: bool = False
    samples: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # cost -> where it came from: "<run>: <metrics> (<records>)" or "default: <why>".
    provenance: dict[str, str] = field(default_factory=dict)
    # The run's CPU placement record (launcher.placement), when the local launcher logged one.
    placement: dict | None = None
    # The run's workload: mean prompt tokens and `empirical:<run>` output lengths (None when its
    # groups did not log them). The costs were fitted on it; simulating another workload (the
    # `simulate` defaults are a reasoning model's 512-token prompts and ~4K-token answers)
    # prices what the run never measured (launcher/simulate/fit_check.py).
    prompt_tokens: int | None = None
    output_lengths: str | None = None
    # Median seconds from a group's last answer to its grades (the groups' `grade_s`): the
    # simulator's `reward_s` unless the config sets one; None when the run did not log it.
    grade_s: float | None = None

    def costs(self, layout: Layout, max_running: int, kv_capacity: float = math.inf) -> Costs:
        # Trainer compute scales with its GPU count; fixed costs do not.
        scale = self.train_world / max(1, layout.train_gpus)
        return Costs(decode_fixed=[0.0] + [self.d0 + self.d1 * n for n in range(1, max_running + 1)],
                     decode_per_ctx=self.d2, kv_capacity=kv_capacity, max_running=max_running,
                     train_fixed=self.t0, train_per_token=max(self.t1 * scale, 1e-15), train_per_sq=0.0,
                     prefill_per_token=self.prefill_per_token, prefill_per_sq=0.0,
                     prefill_per_request=self.prefill_per_request, publish_s=self.publish_s,
                     load_s=self.load_s, checkpoint_s=self.checkpoint_s, request_s=self.request_s,
                     decode_padded=self.decode_padded, decode_pass_s=self.d0 if self.decode_padded else 0.0,
                     notes=list(self.notes))


def placement_note(placement: dict | None) -> str:
    """Whether a run's costs carry over to another eta: only if its pools did not slow each other."""
    if placement is None:
        return ("the run logged no CPU placement (launched without launcher.cpus.pin, or not by the "
                "local launcher): if its roles shared cores, costs measured at one eta do not carry "
                "over to another")
    where = (f"generation on CPUs {placement.get('gen')}, training on {placement.get('train')}, "
             f"light services on {placement.get('services')}")
    shared = placement.get("shared") or []
    if "generation and training share CPUs" in shared:
        return (f"the run's generation and training shared CPUs ({where}): each slowed the other only "
                f"while both ran, so costs from one eta do not carry over to another")
    return f"measured on disjoint pools ({where}); " + ("; ".join(shared) if shared else "no pool shared")


def _provenance(source: str, decode_metrics: str, **counts: int) -> dict[str, str]:
    """Which metrics (and how many records) each fitted cost came from."""
    def src(cost: str, metrics: str, n: int, default: str) -> tuple[str, str]:
        return cost, (f"{source}: {metrics} ({n} records)" if n else f"default: {default}")
    return dict([
        src("decode step (d0, d1, d2)", decode_metrics, counts["gen"], "none"),
        src("prefill (per call, per token)", "gen_prefill_s/gen_prefills/gen_prefill_tokens",
            counts["prefill"], "the marginal decode cost per request"),
        src("request handling", "gen_overhead_s/gen_requests", counts["requests"], "free"),
        src("trainer step (t0, t1)", "train_tokens/train_step_s", counts["train"], "none"),
        src("weight publish", "weight_publish_s", counts["publish"], "free"),
        src("server pause per update", "gen_paused_s or weight_load_s", counts["load"], "free"),
        src("checkpoint", "checkpoint_s", counts["checkpoint"], "free"),
        src("grading latency (reward_s)", "grade_s of the rollout's group records", counts["grade"],
            "simulate.reward_s"),
    ])


def calibrate(exp_dir: str | Path) -> Calibration:
    recs = read_records(exp_dir)
    notes: list[str] = []
    gen = [(r, _decode_step_s(r), _num(r, "gen_running")) for r in recs]
    gen = [(r, dt, n) for r, dt, n in gen if dt and n and dt > 0 and n > 0]
    if not gen:
        raise ConfigError(f"--calibrate {exp_dir}: no generation-server window (gen_decode_s + gen_steps, "
                          f"or gen_tokens_per_s, with gen_running); see docs/simulator.md")
    step = np.array([dt for _, dt, _ in gen])
    running = np.array([n for _, _, n in gen])
    ctx = [_num(r, "gen_context_tokens") for r, _, _ in gen]
    per_step = _fit_moments(recs)
    if per_step:
        d0, d1, d2, steps = per_step
        notes.append(f"decode fitted over {steps} single steps (gen_decode_moments): cost per padded KV entry")
    elif all(c is not None for c in ctx) and len(set(ctx)) > 2:
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
        # Batch sizes too alike (or too noisy) for a slope: the fit kept only the mean as t0.
        # Price the step as proportional to tokens instead, not t0 plus a second full share.
        t0, t1 = 0.0, float((ty / tx).mean())
        notes.append("no trainer slope in the fit (batch sizes too alike): trainer time taken as "
                     "proportional to tokens")
    worlds = [w for w in _values(recs, "train_world_size") if w]
    world = int(worlds[-1]) if worlds else 1
    if not worlds:
        notes.append("no train_world_size: assuming the run trained on 1 rank")
    prefill_call, prefill = _prefill_costs(recs, d1, d0 + d1, notes)
    pub = _values(recs, "weight_publish_s") or _values(recs, "weight_sync_s")
    load = _values(recs, "gen_paused_s") or _values(recs, "weight_load_s") or _values(recs, "weight_sync_s")
    if not pub or not load:
        notes.append("no weight_publish_s / gen_paused_s / weight_load_s: weight sync taken as free")
    ckpt = _values(recs, "checkpoint_s")
    handled = [(_num(r, "gen_overhead_s"), _num(r, "gen_requests")) for r in recs]
    handled = [(s, n) for s, n in handled if s is not None and n]
    request_s = sum(s for s, _ in handled) / sum(n for _, n in handled) if handled else 0.0
    groups = [r for r in recs if r.get("event") == "group" and isinstance(r.get("output_tokens"), list)]
    prompts = [p for r in groups if (p := _num(r, "prompt_tokens"))]
    grades = [g for r in groups if (g := _num(r, "grade_s")) is not None]
    placements = [r for r in recs if r.get("event") == "cpu_placement"]
    placement = placements[-1] if placements else None
    notes.append(placement_note(placement))
    prefill_rows = sum(1 for r in recs if _num(r, "gen_prefill_s") and _num(r, "gen_prefills"))
    decode_metrics = ("gen_decode_moments" if per_step else
                      "gen_decode_s/gen_steps/gen_running/gen_context_tokens")
    provenance = _provenance(str(exp_dir), decode_metrics, gen=len(gen), prefill=prefill_rows,
                             requests=len(handled), train=len(train), publish=len(pub), load=len(load),
                             checkpoint=len(ckpt), grade=len(grades))
    return Calibration(source=str(exp_dir), d0=float(d0), d1=float(d1), d2=float(d2), t0=float(t0),
                       t1=float(t1), train_world=world, prefill_per_token=float(prefill),
                       prefill_per_request=float(prefill_call),
                       publish_s=float(np.median(pub)) if pub else 0.0,
                       load_s=float(np.median(load)) if load else 0.0,
                       checkpoint_s=float(np.median(ckpt)) if ckpt else 0.0, request_s=float(request_s),
                       decode_padded=per_step is not None,
                       samples={"gen windows": len(gen), "trainer steps": len(train),
                                "weight syncs": max(len(pub), len(load))},
                       notes=notes, provenance=provenance, placement=placement,
                       prompt_tokens=round(sum(prompts) / len(prompts)) if prompts else None,
                       output_lengths=f"empirical:{exp_dir}" if any(r["output_tokens"] for r in groups) else None,
                       grade_s=float(np.median(grades)) if grades else None)
