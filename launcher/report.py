"""`tandem report --exp DIR`: a PNG and an HTML page of a run, from `<exp>/metrics.jsonl`.

Made to be read at a glance: every noisy per-step curve is drawn smoothed, with the raw points
faint behind it; held-out accuracy is a curve over steps with its standard error (before the
run, every `rollout.eval_every` versions, after it); staleness bins are whole versions; the
timeline comes twice, the whole run and a window of `ZOOM_S` seconds in its middle, where the
bars are wide enough to see generation and training overlap (the AReaL paper's Figure 3);
throughput, the share of each step spent in weight sync, the training-inference mismatch and
the groups dynamic sampling dropped close the page.
"""
from __future__ import annotations

import base64
import bisect
import html
import io
import json
import sys

from services.protocol import ExpDir, read_metrics

from .progress import run_staleness, run_steps

ZOOM_S = 20.0        # seconds of the zoomed timeline
RAW_ALPHA = 0.25     # raw points behind a smoothed curve


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if key in r and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def smooth(values: list[float], window: int | None = None) -> list[float]:
    """Centred moving average over `window` points (default: a tenth of the run, at least 3),
    shrinking at the ends so the curve spans the whole run without edge artefacts."""
    n = len(values)
    w = window or max(3, n // 10)
    half = w // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return [(prefix[min(n, i + half + 1)] - prefix[max(0, i - half)]) / (min(n, i + half + 1) - max(0, i - half))
            for i in range(n)]


def _raw_and_smooth(ax, x, y, label, color):
    if not x:
        return
    ax.plot(x, y, ".", color=color, alpha=RAW_ALPHA, markersize=3)
    ax.plot(x, smooth(y), "-", color=color, linewidth=2, label=f"{label} (smoothed)")


def held_out_points(exp: ExpDir, records: list[dict], last_step: int) -> list[dict]:
    """Held-out accuracy by step: the `eval` records (before the run at version 0, every
    `rollout.eval_every` versions during it, after it), and for a run whose before/after
    evaluations left only their files (`eval-<tag>.json`), those at step 0 and the last step."""
    points = [{"step": r["step"], "accuracy": r["eval_accuracy"], "se": r.get("eval_se", 0.0),
               "n": r.get("eval_n", 0), "source": r.get("tag") or "during",
               # multi-turn runs: the first turn's pass rate, before any feedback
               **({"first_turn": r["eval_first_turn_accuracy"]} if "eval_first_turn_accuracy" in r else {})}
              for r in records if r.get("event") == "eval" and "eval_accuracy" in r]
    for tag, step in (("before", 0), ("after", last_step)):
        if any(p["source"] == tag for p in points):
            continue
        try:
            r = json.loads((exp.root / f"eval-{tag}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        n = max(r.get("n", 0), 1)
        se = r.get("se", (r["accuracy"] * (1 - r["accuracy"]) / n) ** 0.5)
        points.append({"step": step, "accuracy": r["accuracy"], "se": se, "n": r.get("n", 0), "source": tag})
    order = {"before": 0, "during": 1, "after": 2}
    return sorted(points, key=lambda p: (p["step"], order.get(p["source"], 1)))


def zoom_window(t_end: float, span_s: float = ZOOM_S) -> tuple[float, float]:
    """`span_s` seconds around the middle of a run of `t_end` seconds (the whole run if shorter)."""
    if t_end <= span_s:
        return 0.0, max(t_end, 1e-9)
    mid = t_end / 2
    return mid - span_s / 2, mid + span_s / 2


def _panel_reward(ax, steps):
    x, y = _series(steps, "reward_mean")
    _raw_and_smooth(ax, x, y, "mean reward of trained samples", "tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    if ax.lines:
        ax.legend(loc="lower right")


def _panel_accuracy(ax, steps, groups, held_out):
    if held_out:
        ax.errorbar([p["step"] for p in held_out], [100 * p["accuracy"] for p in held_out],
                    yerr=[100 * p["se"] for p in held_out], color="tab:red", marker="o", capsize=3,
                    linewidth=2, label=f"held-out, greedy (n={held_out[-1]['n']}; ± 1 s.e.)")
        first = [p for p in held_out if "first_turn" in p]
        if first:
            ax.plot([p["step"] for p in first], [100 * p["first_turn"] for p in first], color="tab:red",
                    linestyle="--", marker=".", label="held-out, first turn (before feedback)")
    if groups and steps:  # each group's sample accuracy at the step current when it finished
        times = [r["time"] for r in steps]
        by_step: dict[int, list[float]] = {}
        for g in groups:
            step = steps[min(bisect.bisect(times, g["time"]), len(steps) - 1)]["step"]
            by_step.setdefault(step, []).append(100 * g.get("correct", 0.0))
        x = sorted(by_step)
        _raw_and_smooth(ax, x, [sum(by_step[s]) / len(by_step[s]) for s in x], "training samples", "tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy: held-out over steps, and of training samples")
    if ax.lines or ax.containers:
        ax.legend(loc="lower right")


def _panel_staleness(ax, steps):
    hist = run_staleness(steps)
    bins = list(range(0, max(hist, default=0) + 1))
    ax.bar(bins, [hist.get(b, 0) for b in bins])
    ax.set_xticks(bins)
    ax.set_xlabel("staleness (trained step - admit version)")
    ax.set_ylabel("groups")
    ax.set_title("staleness histogram")


def _panel_timeline(ax, groups, steps, syncs, t0, window=None):
    lanes = sorted({r.get("rank", 0) for r in groups})
    for lane in lanes:
        bars = [(r["time"] - r["seconds"] - t0, r["seconds"]) for r in groups if r.get("rank", 0) == lane]
        ax.broken_barh(bars, (lane * 2, 1.6), alpha=0.25, color="tab:blue", edgecolor="tab:blue", linewidth=0.3)
    train_y = 2 * (len(lanes) or 1)
    # Compute only (proximal pass + updates): the wait for data is idle time, not training.
    ax.broken_barh([(r["time"] - r.get("step_s", 0) + r.get("wait_s", 0) - t0, r.get("prox_s", 0) + r.get("train_s", 0))
                    for r in steps], (train_y, 1.6), color="tab:red")
    ax.broken_barh([(r["time"] - r.get("seconds", 0) - t0, r.get("seconds", 0)) for r in syncs],
                   (train_y + 2, 1.6), color="tab:purple")
    ax.set_yticks([2 * lane + 0.8 for lane in lanes] + [train_y + 0.8, train_y + 2.8])
    ax.set_yticklabels([f"rollout-{lane}" for lane in lanes] + ["trainer", "weight sync"])
    ax.set_xlabel("seconds since start")
    if window:
        ax.set_xlim(*window)
        ax.set_title(f"timeline, {window[1] - window[0]:.0f} s in the middle: generation and training overlap")
    else:
        ax.set_title("timeline: generation (groups) vs training (steps), whole run")


def _panel_sync_phases(ax, syncs):
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


def _panel_throughput(ax, steps):
    x, y = _series(steps, "tokens_per_s")
    _raw_and_smooth(ax, x, y, "trained tokens/s", "tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("trained tokens/s")
    ax.set_title("training throughput; answers the reward refused")
    ax2 = ax.twinx()
    for key, label in (("reward_hedged", "hedged"), ("reward_limits_hit", "stopped at a limit")):
        x, y = _series(steps, key)
        if any(y):
            ax2.plot(x, y, linestyle="--", label=label)
    ax2.set_ylabel("answers per step")
    if ax.lines:
        ax.legend(loc="upper left")
    if ax2.lines:
        ax2.legend(loc="upper right")


def _panel_step_time(ax, steps):
    pts = [(r["step"], r["step_s"], r.get("weight_sync_s", 0.0)) for r in steps if r.get("step_s")]
    if pts:
        _raw_and_smooth(ax, [p[0] for p in pts], [p[1] for p in pts], "whole step (s)", "tab:gray")
        _raw_and_smooth(ax, [p[0] for p in pts], [p[2] for p in pts], "weight sync (s)", "tab:purple")
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in pts], smooth([100 * p[2] / p[1] for p in pts]), color="tab:orange",
                 linestyle=":", linewidth=2, label="weight sync share of the step (%)")
        ax2.set_ylabel("share (%)")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="center right")
        ax.legend(loc="upper left")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title("seconds per step and in weight sync")


def _panel_mismatch(ax, steps):
    """Generator vs trainer log-probs of the tokens generated at the version being trained: with
    the same weights, about 0; kernels, precision or a stale server show here first."""
    x, y = _series(steps, "mismatch_k3")
    if x:
        ax.semilogy(x, [max(v, 1e-12) for v in y], ".-", color="tab:brown", label="mismatch_k3 (log)")
        ax.legend(loc="upper left")
    ax.set_xlabel("step")
    ax.set_ylabel("k3 KL, trainer vs generator")
    ax.set_title("training-inference mismatch (current-version tokens)")
    ax2 = ax.twinx()
    for key, style in (("mismatch_ratio_max", "--"), ("mismatch_ratio_mean", ":")):
        x, y = _series(steps, key)
        if x:
            ax2.plot(x, y, linestyle=style, color="tab:gray", label=key)
    ax2.set_ylabel("trainer / generator probability")
    if ax2.lines:
        ax2.legend(loc="upper right")


def _panel_filtered(ax, steps):
    x, y = _series(steps, "dynamic_filtered_groups")
    ax.bar(x, y, color="tab:olive")
    if not any(y):
        ax.text(0.5, 0.5, "none dropped (rollout.filter_all_equal is off, or every group had a spread)",
                transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_title("groups dropped by dynamic sampling (all rewards equal)")


def build_figure(exp: ExpDir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(exp)  # one pass over the stream, then split by role and event
    steps = run_steps([r for r in records if r.get("role") == "trainer"])
    groups = [r for r in records if r.get("role") == "rollout" and r.get("event") == "group"]
    syncs = [r for r in records if r.get("role") == "controller" and r.get("event") == "weight_sync"]
    held_out = held_out_points(exp, records, steps[-1]["step"] if steps else 0)
    starts = [r["time"] - r.get("seconds", 0) for r in groups] + [r["time"] - r.get("step_s", 0) for r in steps]
    t0 = min(starts, default=0.0)
    t_end = max([r["time"] for r in groups + steps], default=t0) - t0
    fig, axes = plt.subplots(5, 2, figsize=(14, 21))
    _panel_reward(axes[0, 0], steps)
    _panel_accuracy(axes[0, 1], steps, groups, held_out)
    _panel_timeline(axes[1, 0], groups, steps, syncs, t0)
    _panel_timeline(axes[1, 1], groups, steps, syncs, t0, window=zoom_window(t_end))
    _panel_staleness(axes[2, 0], steps)
    _panel_sync_phases(axes[2, 1], syncs)
    _panel_throughput(axes[3, 0], steps)
    _panel_step_time(axes[3, 1], steps)
    _panel_mismatch(axes[4, 0], steps)
    _panel_filtered(axes[4, 1], steps)
    fig.tight_layout()
    return fig, {"steps": len(steps), "groups": len(groups), "weight_syncs": len(syncs),
                 "held_out_points": len(held_out)}


def _headline(summary: dict) -> list[tuple[str, str]]:
    """The figures a reader wants before the plots, from summary.json."""
    ev, tp, ws = summary.get("eval") or {}, summary.get("throughput") or {}, summary.get("weight_sync") or {}
    rows = []
    if ev.get("before") is not None and ev.get("after") is not None:
        rows.append(("held-out accuracy", f"{100 * ev['before']:.1f}% → {100 * ev['after']:.1f}%"))
    for key, label in (("steps", "training steps"), ("wall_s", "wall seconds")):
        if summary.get(key) is not None:
            rows.append((label, f"{summary[key]:,.0f}"))
    if tp.get("trajectories_per_s") is not None:
        rows.append(("trajectories/s", f"{tp['trajectories_per_s']:.2f}"))
    if ws.get("mean_s") is not None:
        rows.append(("weight sync, mean s", f"{ws['mean_s']:.2f}"))
    return rows


def write_report(exp: ExpDir) -> tuple:
    fig, counts = build_figure(exp)
    exp.report.mkdir(parents=True, exist_ok=True)
    png = exp.report / "report.png"
    fig.savefig(png, dpi=80)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    summary_file = exp.root / "summary.json"
    summary_text = summary_file.read_text() if summary_file.exists() else "{}"
    try:
        headline = _headline(json.loads(summary_text))
    except json.JSONDecodeError:
        headline = []
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in headline)
    page = exp.report / "report.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>Tandem run report</title>"
        "<style>body{font-family:sans-serif;margin:1.5em;background:#fff}th{text-align:left;padding-right:1em}"
        "img{max-width:100%}</style>"
        f"<h1>{html.escape(exp.root.name)}</h1><p>{counts['steps']} training steps, {counts['groups']} groups, "
        f"{counts['weight_syncs']} weight syncs, {counts['held_out_points']} held-out evaluations.</p>"
        f"<table>{table}</table>"
        f"<img alt='run report' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"
        f"<details><summary>summary.json</summary><pre>{html.escape(summary_text)}</pre></details>")
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
    p = sub.add_parser("report", help="plot a run: reward, held-out accuracy, staleness, timeline")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.set_defaults(func=cmd_report)
