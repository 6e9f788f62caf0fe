"""`tandem report --exp DIR`: a PNG and an HTML page of a run, from `<exp>/metrics.jsonl`.

Panels: reward and accuracy over steps; the staleness histogram; a timeline of generation
(one bar per group, per rollout worker) against training (one bar per step) — the picture that
shows whether the two sides overlap, as in the AReaL paper's Figure 3; weight-sync phases; and
throughput.
"""
from __future__ import annotations

import base64
import html
import io
import json
import sys

from services.protocol import ExpDir, read_metrics

from .progress import run_staleness, run_steps


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if key in r and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def build_figure(exp: ExpDir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(exp)  # one pass over the stream, then split by role and event
    steps = run_steps([r for r in records if r.get("role") == "trainer"])
    groups = [r for r in records if r.get("role") == "rollout" and r.get("event") == "group"]
    syncs = [r for r in records if r.get("role") == "controller" and r.get("event") == "weight_sync"]
    t0 = min([r["time"] - r.get("seconds", 0) for r in groups] + [r["time"] - r.get("step_s", 0) for r in steps]
             + [float("inf")])
    fig, axes = plt.subplots(3, 2, figsize=(13, 11))
    ax = axes[0, 0]
    x, y = _series(steps, "reward_mean")
    ax.plot(x, y, marker=".", label="mean reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    acc_t = [(r["time"], 100 * r.get("correct", 0.0)) for r in groups]
    step_t = [(r["time"], r["step"]) for r in steps]
    if acc_t and step_t:  # each group's accuracy at the step that was current when it finished
        import bisect
        times = [t for t, _ in step_t]
        xs = [step_t[min(bisect.bisect(times, t), len(step_t) - 1)][1] for t, _ in acc_t]
        ax2.scatter(xs, [a for _, a in acc_t], s=6, color="tab:green", alpha=0.3)
    ax2.set_ylabel("group accuracy of samples (%)")
    ax.set_title("reward and accuracy")
    ax = axes[0, 1]
    hist = run_staleness(steps)
    ax.bar(list(hist), list(hist.values()))
    ax.set_xlabel("staleness (trained step - admit version)")
    ax.set_ylabel("groups")
    ax.set_title("staleness histogram")
    ax = axes[1, 0]
    lanes = sorted({r.get("rank", 0) for r in groups})
    for lane in lanes:
        bars = [(r["time"] - r["seconds"] - t0, r["seconds"]) for r in groups if r.get("rank", 0) == lane]
        ax.broken_barh(bars, (lane * 2, 1.6), alpha=0.25, color="tab:blue")
    train_y = 2 * (len(lanes) or 1)
    # Compute only (proximal pass + updates): the wait for data is idle time, not training.
    ax.broken_barh([(r["time"] - r.get("step_s", 0) + r.get("wait_s", 0) - t0, r.get("prox_s", 0) + r.get("train_s", 0))
                    for r in steps], (train_y, 1.6), color="tab:red")
    ax.broken_barh([(r["time"] - r.get("seconds", 0) - t0, r.get("seconds", 0)) for r in syncs],
                   (train_y + 2, 1.6), color="tab:purple")
    ax.set_yticks([2 * lane + 0.8 for lane in lanes] + [train_y + 0.8, train_y + 2.8])
    ax.set_yticklabels([f"rollout-{lane}" for lane in lanes] + ["trainer", "weight sync"])
    ax.set_xlabel("seconds since start")
    ax.set_title("timeline: generation (groups) vs training (steps)")
    ax = axes[1, 1]
    phases = sorted({k for r in syncs for k in (r.get("phases") or {})})
    bottom = [0.0] * len(syncs)
    for ph in phases:
        vals = [(r.get("phases") or {}).get(ph, 0.0) for r in syncs]
        ax.bar([r.get("version", i) for i, r in enumerate(syncs)], vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("version")
    ax.set_ylabel("seconds")
    ax.set_title("weight-sync phases")
    if phases:
        ax.legend()
    ax = axes[2, 0]
    x, y = _series(steps, "tokens_per_s")
    ax.plot(x, y, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("trained tokens/s")
    ax.set_title("training throughput; answers the reward refused")
    ax2 = ax.twinx()
    for key, label in (("reward_hedged", "hedged"), ("reward_limits_hit", "stopped at a limit")):
        x, y = _series(steps, key)
        if any(y):
            ax2.plot(x, y, linestyle="--", label=label)
    ax2.set_ylabel("answers per step")
    if ax2.lines:
        ax2.legend(loc="upper right")
    ax = axes[2, 1]
    x, y = _series(steps, "weight_sync_s")
    ax.plot(x, y, marker=".", label="weight sync (s)")
    x, y = _series(steps, "step_s")
    ax.plot(x, y, marker=".", label="whole step (s)")
    ax.set_xlabel("step")
    ax.legend()
    ax.set_title("seconds per step and in weight sync")
    fig.tight_layout()
    return fig, {"steps": len(steps), "groups": len(groups), "weight_syncs": len(syncs)}


def write_report(exp: ExpDir) -> tuple:
    fig, counts = build_figure(exp)
    exp.report.mkdir(parents=True, exist_ok=True)
    png = exp.report / "report.png"
    fig.savefig(png, dpi=90)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    summary = exp.root / "summary.json"
    summary_text = summary.read_text() if summary.exists() else "{}"
    page = exp.report / "report.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>Tandem run report</title>"
        f"<h1>{html.escape(exp.root.name)}</h1><p>{counts['steps']} training steps, {counts['groups']} groups, "
        f"{counts['weight_syncs']} weight syncs.</p><h2>Summary</h2><pre>{html.escape(summary_text)}</pre>"
        f"<img alt='run report' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>")
    return png, page, counts


def cmd_report(args) -> int:
    exp = ExpDir(args.exp_dir)
    if not exp.metrics.exists():
        print(f"tandem report: {exp.metrics} not found; is {exp.root} an experiment directory?", file=sys.stderr)
        return 2
    png, page, counts = write_report(exp)
    print(json.dumps({"png": str(png), "html": str(page), **counts}))
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="plot a run: reward, staleness, generation/training timeline")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.set_defaults(func=cmd_report)
