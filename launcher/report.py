"""`tandem report --exp DIR`: a PNG and an HTML page of a run, from `<exp>/metrics.jsonl`.

Made to be read at a glance: every noisy per-step curve is drawn smoothed, with the raw points
faint behind it; held-out accuracy is a curve over steps with its standard error (before the
run, every `rollout.eval_every` versions, after it); staleness bins are whole versions; the
timeline comes twice, the whole run and a window of `ZOOM_S` seconds in its middle, where the
bars are wide enough to see generation and training overlap (the AReaL paper's Figure 3);
throughput, the share of each step spent in weight sync, the training-inference mismatch and
the groups dynamic sampling dropped close the page.

It also explains itself (`RunInfo`): a title naming the run, its experiment file, start date
and commit (`<exp>/launches.jsonl`, `launcher/run_info.py`); an empty panel says why (evaluation
off, no weight sync, no token at its own version ...); y-axes have a floor on their span and
print their value, so noise never reads as a trend (`launcher/report_axes.py`); a resumed run
is marked on the time axes.
"""
from __future__ import annotations

import base64
import bisect
import html
import io
import json
import sys
import time

from tandem.services.protocol import ExpDir, read_metrics

from .progress import run_staleness, run_steps
from .report_axes import (
    NO_OFFSET,
    fmt,
    label_points,
    log_span_floor,
    mark_resumes,
    note_why,
    print_value,
    span_floor,
)
from .report_records import STYLE, learning_html, learning_lines, samples_html, samples_of
from .run_info import RunInfo, run_info

ZOOM_S = 20.0        # seconds of the zoomed timeline
RATIO = "{:.7g}".format   # a probability ratio near 1: 1.000001, not 1
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


def _why(ax, notes: dict, why: str, y: float = 0.5) -> None:
    """An empty panel (or an empty part of one) says why, on the figure and in the page's notes."""
    note_why(ax, why, y)
    notes[ax.get_title()] = why


def _panel_reward(ax, steps, info: RunInfo, notes: dict):
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    x, y = _series(steps, "reward_mean")
    if not x:
        return _why(ax, notes, "no training step recorded yet")
    _raw_and_smooth(ax, x, y, "mean reward of trained samples", "tab:blue")
    lo_hi = info.reward_range if info.reward_range and info.reward_range[1] > info.reward_range[0] else None
    # A quarter of what the reward can span: a flat reward stays flat on the page.
    floor = 0.25 * (lo_hi[1] - lo_hi[0]) if lo_hi else max(0.5, 0.25 * max(abs(v) for v in y))
    span_floor(ax, y, floor, bounds=lo_hi)
    print_value(ax, f"last {fmt(smooth(y)[-1])} (smoothed); raw {fmt(min(y))} to {fmt(max(y))}")
    ax.legend(loc="center right")


def _panel_accuracy(ax, steps, groups, held_out, info: RunInfo, notes: dict):
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy: held-out over steps, and of training samples")
    shown, said = [], []
    if held_out:
        ys = [100 * p["accuracy"] for p in held_out]
        ax.errorbar([p["step"] for p in held_out], ys,
                    yerr=[100 * p["se"] for p in held_out], color="tab:red", marker="o", capsize=3,
                    linewidth=2, label=f"held-out, greedy (n={held_out[-1]['n']}; ± 1 s.e.)")
        shown += ys
        said.append(f"held-out {ys[0]:.1f}%" + (f" → {ys[-1]:.1f}%" if len(ys) > 1 else ""))
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
        y = [sum(by_step[s]) / len(by_step[s]) for s in x]
        _raw_and_smooth(ax, x, y, "training samples", "tab:green")
        shown += y
        said.append(f"training samples {smooth(y)[-1]:.1f}% (last, smoothed)")
    if not held_out:
        _why(ax, notes, info.why_no_held_out(), y=0.7 if shown else 0.5)
    if not shown:
        note_why(ax, "no rollout group finished during a training step", y=0.3)
        return
    span_floor(ax, shown, 20.0, bounds=(0.0, 100.0))   # at least 20 points of accuracy
    print_value(ax, "; ".join(said))
    ax.legend(loc="upper right")


def _panel_staleness(ax, steps, notes: dict):
    hist = run_staleness(steps)
    bins = list(range(0, max(hist, default=0) + 1))
    ax.bar(bins, [hist.get(b, 0) for b in bins])
    ax.set_xticks(bins)
    ax.set_xlabel("staleness (trained step - admit version)")
    ax.set_ylabel("groups")
    ax.set_title("staleness histogram")
    if not hist:
        _why(ax, notes, "no staleness recorded (the trainer logs it with each step; none yet)")


def _panel_timeline(ax, groups, steps, syncs, t0, info, notes: dict, window=None):
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
    lo, hi = window or (-float("inf"), float("inf"))
    marks = [(t - t0, label) for t, label in zip(info.resumes, info.resume_labels(), strict=True)
             if lo <= t - t0 <= hi]
    mark_resumes(ax, [x for x, _ in marks], [label for _, label in marks])
    joins = [(c["time"] - t0, c["label"]) for c in info.server_changes if lo <= c["time"] - t0 <= hi]
    mark_resumes(ax, [x for x, _ in joins], [label for _, label in joins], linestyle=":", color="tab:green", y=0.9)
    if not groups and not steps:
        _why(ax, notes, "no rollout group and no training step recorded")


def _panel_sync_phases(ax, syncs, notes: dict):
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
        print_value(ax, f"median {fmt(sorted(bottom)[len(bottom) // 2])} s a sync", loc="upper right")
    elif syncs:
        _why(ax, notes, f"{len(syncs)} weight syncs logged no phase timings")
    else:
        _why(ax, notes, "no weight sync recorded (the controller logs one per new version)")


def _panel_throughput(ax, steps, notes: dict):
    x, y = _series(steps, "tokens_per_s")
    _raw_and_smooth(ax, x, y, "trained tokens/s", "tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("trained tokens/s")
    ax.set_title("training throughput; answers the reward refused")
    ax2 = ax.twinx()
    for key, label in (("reward_hedged", "hedged"), ("reward_limits_hit", "stopped at a limit")):
        xs, ys = _series(steps, key)
        if any(ys):
            ax2.plot(xs, ys, linestyle="--", label=label)
    ax2.set_ylabel("answers per step")
    ax2.set_ylim(bottom=0)
    if ax.lines:
        ax.set_ylim(bottom=0)   # a rate from zero: a flat one stays flat
        ax.legend(loc="upper left")
        print_value(ax, f"last {fmt(smooth(y)[-1])} tokens/s (smoothed)", loc="lower left")
    else:
        _why(ax, notes, "no training step recorded tokens/s")
    if ax2.lines:
        ax2.legend(loc="upper right")


def _panel_step_time(ax, steps, notes: dict):
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("seconds per step and in weight sync")
    pts = [(r["step"], r["step_s"], r.get("weight_sync_s", 0.0)) for r in steps if r.get("step_s")]
    if not pts:
        return _why(ax, notes, "no training step recorded its seconds")
    _raw_and_smooth(ax, [p[0] for p in pts], [p[1] for p in pts], "whole step (s)", "tab:gray")
    _raw_and_smooth(ax, [p[0] for p in pts], [p[2] for p in pts], "weight sync (s)", "tab:purple")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot([p[0] for p in pts], smooth([100 * p[2] / p[1] for p in pts]), color="tab:orange",
             linestyle=":", linewidth=2, label="weight sync share of the step (%)")
    ax2.set_ylabel("share (%)")
    ax2.set_ylim(bottom=0)
    ax2.legend(loc="center right")
    ax.legend(loc="upper left")
    median = sorted(p[1] for p in pts)[len(pts) // 2]
    print_value(ax, f"median step {fmt(median)} s", loc="lower left")


def _panel_mismatch(ax, steps, notes: dict):
    """Generator vs trainer log-probs of the tokens generated at the version being trained: with
    the same weights, about 0; kernels, precision or a stale server show here first."""
    ax.set_xlabel("step")
    ax.set_ylabel("k3 KL, trainer vs generator")
    ax.set_title("training-inference mismatch (current-version tokens)")
    x, y = _series(steps, "mismatch_k3")
    if not x:
        return _why(ax, notes, "no step trained a token generated at its own version (mismatch_tokens 0: "
                               "with max_staleness > 0 most tokens are older), so nothing to compare")
    positive = [v for v in y if v > 0]
    drawn = [v if v > 0 else min(positive, default=1e-12) / 10 for v in y]   # a log axis has no 0
    ax.semilogy(x, drawn, ".-", color="tab:brown", label="mismatch_k3 (log)")
    log_span_floor(ax, drawn)
    label_points(ax, x, y, "tab:brown", at=drawn)
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    ratios = []
    for i, (key, style) in enumerate((("mismatch_ratio_max", "--"), ("mismatch_ratio_mean", ":"))):
        xs, ys = _series(steps, key)
        if xs:
            ax2.plot(xs, ys, linestyle=style, marker="." if len(xs) <= 3 else None, color="tab:gray", label=key)
            label_points(ax2, xs, ys, "tab:gray", text=RATIO, row=i + 1)
            ratios += ys
    ax2.set_ylabel("trainer / generator probability")
    if ax2.lines:
        span_floor(ax2, ratios + [1.0], 0.02)   # 1.000001 is 1 on the axis, and its label says the rest
        ax2.legend(loc="upper right")
    if steps:   # the whole run on the x axis, so one point is seen where in the run it fell
        ax.set_xlim(steps[0]["step"] - 0.5, steps[-1]["step"] + 0.5)
    print_value(ax, f"k3 last {fmt(y[-1])} over {len(x)} of {len(steps)} steps"
                + (f"; ratio max {RATIO(max(ratios))}" if ratios else ""), loc="lower left")


def _panel_filtered(ax, steps, notes: dict):
    x, y = _series(steps, "dynamic_filtered_groups")
    ax.bar(x, y, color="tab:olive")
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_title("groups dropped by dynamic sampling (all rewards equal)")
    if not any(y):
        _why(ax, notes, "none dropped (rollout.filter_all_equal is off, or every group had a spread)")


def build_figure(exp: ExpDir, records: list[dict] | None = None, info: RunInfo | None = None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(exp) if records is None else records   # one pass, then split by role and event
    info = info or run_info(exp, records)
    steps = run_steps([r for r in records if r.get("role") == "trainer"])
    groups = [r for r in records if r.get("role") == "rollout" and r.get("event") == "group"]
    syncs = [r for r in records if r.get("role") == "controller" and r.get("event") == "weight_sync"]
    held_out = held_out_points(exp, records, steps[-1]["step"] if steps else 0)
    starts = [r["time"] - r.get("seconds", 0) for r in groups] + [r["time"] - r.get("step_s", 0) for r in steps]
    t0 = min(starts, default=0.0)
    t_end = max([r["time"] for r in groups + steps], default=t0) - t0
    notes: dict[str, str] = {}
    with matplotlib.rc_context(NO_OFFSET):
        fig, axes = plt.subplots(5, 2, figsize=(14, 21.6))
        fig.suptitle(f"{info.title()}\n{info.subtitle()}", fontsize=15)
        _panel_reward(axes[0, 0], steps, info, notes)
        _panel_accuracy(axes[0, 1], steps, groups, held_out, info, notes)
        _panel_timeline(axes[1, 0], groups, steps, syncs, t0, info, notes)
        _panel_timeline(axes[1, 1], groups, steps, syncs, t0, info, notes, window=zoom_window(t_end))
        _panel_staleness(axes[2, 0], steps, notes)
        _panel_sync_phases(axes[2, 1], syncs, notes)
        _panel_throughput(axes[3, 0], steps, notes)
        _panel_step_time(axes[3, 1], steps, notes)
        _panel_mismatch(axes[4, 0], steps, notes)
        _panel_filtered(axes[4, 1], steps, notes)
        for ax in fig.axes:   # steps and versions are whole numbers: no tick at step 0.96
            if ax.get_xlabel() in ("step", "version"):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        # Fixed margins, not tight_layout: the grid never changes, and measuring every label to
        # fit it cost as much as drawing the figure (about a second at the end of every run).
        fig.subplots_adjust(left=0.08, right=0.94, bottom=0.03, top=0.93, wspace=0.4, hspace=0.3)
    return fig, {"steps": len(steps), "groups": len(groups), "weight_syncs": len(syncs),
                 "held_out_points": len(held_out), "notes": notes}


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


def _summary(exp: ExpDir) -> tuple[str, list[tuple[str, str]], dict]:
    """summary.json's text, its headline rows and itself (none when absent or unreadable)."""
    summary_file = exp.root / "summary.json"
    text = summary_file.read_text() if summary_file.exists() else "{}"
    try:
        summary = json.loads(text)
        return text, _headline(summary), summary
    except (json.JSONDecodeError, AttributeError):
        return text, [], {}


def write_report(exp: ExpDir) -> tuple:
    import matplotlib.pyplot as plt

    records = read_metrics(exp)
    info = run_info(exp, records)
    fig, counts = build_figure(exp, records, info)
    counts["run"] = {"name": info.name, "config": info.config_file, "started": info.started,
                     "commit": info.commit, "resumed_at": info.resumes, "resume_marks": info.resume_labels(),
                     "continued": info.continued, "server_changes": info.server_changes}
    summary_text, headline, summary = _summary(exp)
    counts["learning"] = learning_lines(records, summary)   # the verdict, a stop, the warnings
    counts["sample_records"] = len(samples_of(records, last=len(records)))
    exp.report.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    png = exp.report / "report.png"
    png.write_bytes(buf.getvalue())
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in headline)
    notes = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in counts["notes"].items())
    page = exp.report / "report.html"
    page.write_text(
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(info.title())}</title>"
        "<style>body{font-family:sans-serif;margin:1.5em;background:#fff}th{text-align:left;padding-right:1em}"
        f"img{{max-width:100%}}.notes{{color:#555}}{STYLE}</style>"
        f"<h1>{html.escape(info.title())}</h1><p class='run'>{html.escape(info.subtitle())}</p>"
        f"<p>{counts['steps']} training steps, {counts['groups']} groups, "
        f"{counts['weight_syncs']} weight syncs, {counts['held_out_points']} held-out evaluations.</p>"
        f"<table>{table}</table>" + learning_html(records, summary)
        + (f"<ul class='notes'>{notes}</ul>" if notes else "")
        + f"<img alt='run report' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"
        + samples_html(records)
        + f"<details><summary>summary.json</summary><pre>{html.escape(summary_text)}</pre></details>")
    return png, page, counts


def report_text(exp: ExpDir, png, page, counts: dict) -> str:
    """What `tandem report` prints: the run, its headline figures, the empty panels and why,
    and where the page is (`--json` prints the same as one JSON object)."""
    run = counts["run"]
    info = RunInfo(name=run["name"], config_file=run["config"], started=run["started"], commit=run["commit"],
                   resumes=run["resumed_at"], continued=run.get("continued", []),
                   server_changes=run.get("server_changes", []))
    lines = [f"{info.title()} ({exp.root})", f"  {info.subtitle()}",
             f"  {counts['steps']} training steps, {counts['groups']} groups, {counts['weight_syncs']} weight "
             f"syncs, {counts['held_out_points']} held-out evaluations"]
    if info.continued:   # launcher/continuation.py: the launcher resumed the run by itself
        lines.append("  continued by the launcher: " + ", ".join(
            f"#{k} after {c.get('role') or 'a job'} {c.get('cause')} at "
            f"{time.strftime('%H:%M:%S', time.localtime(c['time']))}" for k, c in enumerate(info.continued, 1)))
    if info.server_changes:   # launcher/scaling.py, launcher/elastic.py
        lines.append("  generation servers: " + ", ".join(f"{c['label']} at step {c['step']}"
                                                         for c in info.server_changes))
    headline = _summary(exp)[1]
    lines += [f"  {line}" for line in counts.get("learning", [])]
    width = max((len(k) for k, _ in headline), default=0)
    lines += [f"  {k:<{width}}  {v}" for k, v in headline]
    if counts["notes"]:
        lines.append("  empty panels:")
        lines += [f"    {k}: {v}" for k, v in counts["notes"].items()]
    lines += [f"report: {page}", f"image:  {png}"]
    return "\n".join(lines)


def cmd_report(args) -> int:
    exp = ExpDir(args.exp_dir)
    if not exp.metrics.exists():
        print(f"tandem report: {exp.metrics} not found; is {exp.root} an experiment directory?", file=sys.stderr)
        return 2
    png, page, counts = write_report(exp)
    if args.json:
        print(json.dumps({"png": str(png), "html": str(page), **counts}))
    else:
        print(report_text(exp, png, page, counts))
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="plot a run: reward, held-out accuracy, staleness, timeline")
    p.add_argument("--exp", dest="exp_dir", required=True, help="experiment directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_report)
