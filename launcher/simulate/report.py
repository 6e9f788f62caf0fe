"""What `tandem simulate` prints and draws: one configuration's prediction, or a sweep's grid."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tandem.launcher.simulate.engine import SimResult
from tandem.launcher.simulate.scenario import Scenario, Sweep


def staleness_text(counter) -> str:
    total = sum(counter.values()) or 1
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(counter.items()))


def result_rows(sc: Scenario, r: SimResult, total_steps: int) -> list[tuple[str, str]]:
    su = sc.setup
    mode = "synchronous" if su.eta == 0 else f"asynchronous (eta={su.eta})"
    if sc.cfg.simulate.colocated:
        mode += ", colocated"
    return [
        ("mode", f"{mode}, " + (("interruptible generation (interrupted requests "
                                  + ("resubmitted by the workers)" if su.resubmit_interrupted
                                     else "kept on the server)"))
                                 if su.interruptible else "non-interruptible generation"
                                 + (" (coalesced versions)" if su.coalesce_versions else ""))),
        ("generation servers", f"{sc.layout.num_servers} x TP {sc.layout.gen_tp}"),
        ("trainer GPUs", f"{sc.layout.train_gpus} (TP {sc.layout.train_tp} x PP {sc.layout.train_pp})"),
        ("batch", f"{sc.cfg.trainer.groups_per_step} groups x {su.n_samples} samples, up to "
                  f"{su.max_new_tokens:,} new tokens"),
        ("training steps / hour", f"{r.steps_per_hour:.2f}"),
        ("seconds / step", f"{r.step_s:.1f}"),
        (f"hours for trainer.total_steps={total_steps}", f"{total_steps / r.steps_per_hour:.1f}"),
        ("trajectories / s", f"{r.trajectories_per_s:.1f}"),
        ("generated tokens / s", f"{r.gen_tokens_per_s:,.0f}"),
        ("trained tokens / s", f"{r.trained_tokens_per_s:,.0f}"),
        ("generation pool busy", f"{100 * r.gen_utilization:.0f}% (mean batch {r.mean_batch:.0f})"),
        ("trainer pool busy", f"{100 * r.train_utilization:.0f}%"),
        ("staleness (step - admit version)", staleness_text(r.staleness)),
        ("staleness of oldest token", staleness_text(r.token_staleness)),
        ("interrupted requests / KV retractions", f"{r.interrupts} / {r.retractions}"),
        *([("server time draining / syncs per step", f"{100 * r.drain_fraction:.0f}% / {r.syncs_per_step:.2f}")]
          if not su.interruptible else []),
        *([("chunks resumed (rollout.new_tokens_per_chunk) / longest drain",
            f"{r.chunk_resumes} / {r.longest_drain_s:.1f} s")] if su.chunk_tokens else []),
    ]


def print_result(sc: Scenario, r: SimResult, console: Console | None = None) -> None:
    console = console or Console()
    la = sc.cfg.launcher
    where = (f"{la.nodes} nodes x {la.gpus_per_node} GPUs, ratio {la.gen_train_ratio}" if sc.plan
             else f"{sc.setup.num_servers} embedded CPU servers")
    t = Table(title=f"Simulated: {sc.cfg.experiment.name} on {where}")
    t.add_column("prediction")
    t.add_column("value", justify="right")
    for k, v in result_rows(sc, r, sc.cfg.trainer.total_steps):
        t.add_row(k, v)
    console.print(t)
    for n in sc.notes:
        console.print(f"note: {n}")


def print_calibration(cal, console: Console | None = None) -> None:
    """Which run (and which of its metrics) every cost came from, and what the run shared."""
    console = console or Console()
    # Plain lines, not a table: paths are long, and scripts grep this.
    console.print(f"costs calibrated from {cal.source} ({cal.samples}):", soft_wrap=True)
    for cost, source in cal.provenance.items():
        console.print(f"  {cost}: {source}", soft_wrap=True, highlight=False)
    for n in cal.notes:
        console.print(f"note: {n}")


def print_sweep(sw: Sweep, eta_now: int, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="Training steps / hour by generation:training ratio (rows) and eta (columns)")
    t.add_column("ratio")
    for e in sw.etas:
        t.add_column(f"eta={e}", justify="right")
    best = sw.best()
    for r in sw.ratios:
        row = []
        for e in sw.etas:
            c = sw.cells[(r, e)]
            if c.result is None:
                row.append("-")
            else:
                mark = " *" if best is c else ""
                row.append(f"{c.result.steps_per_hour:.2f}{mark}")
        t.add_row(r, *row)
    console.print(t)
    errors = {c.error for c in sw.cells.values() if c.error}
    for err in sorted(errors):
        console.print(f"not simulated: {err}")
    if best:
        console.print(f"fastest: ratio {best.ratio} with eta={best.eta} "
                      f"({best.result.steps_per_hour:.2f} steps/h)")
    here = sw.best(eta_now)
    if here:
        console.print(f"recommended split at the configured eta={eta_now}: {here.ratio} "
                      f"({here.result.steps_per_hour:.2f} steps/h)")


def plot_sweep(sw: Sweep, out: str | Path, title: str = "") -> Path:
    """Throughput vs eta, one line per ratio; the best point circled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in sw.ratios:
        pts = [(e, sw.cells[(r, e)].result.steps_per_hour) for e in sw.etas if sw.cells[(r, e)].result]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"gen:train {r}")
    best = sw.best()
    if best:
        ax.scatter([best.eta], [best.result.steps_per_hour], s=250, facecolors="none",
                   edgecolors="black", label=f"best: {best.ratio}, eta={best.eta}")
    ax.set_xlabel("eta (max staleness; 0 = synchronous)")
    ax.set_ylabel("training steps / hour (simulated)")
    ax.set_title(title or "Simulated throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def print_elastic(pred, console: Console | None = None) -> None:
    """`--elastic`: the three runs (fixed at the start, fixed in hindsight, elastic), then the
    phases: which split is fastest as the lengths grow, and where the elastic run is."""
    console = console or Console()
    hours = {k: v / 3600 for k, v in pred.seconds.items()}
    t = Table(title=f"Elastic split over trainer.total_steps={pred.total_steps} (lengths x{pred.growth:g} "
                    f"by the end; decisions every {pred.every_steps} steps, min gain {100 * pred.min_gain:.0f}%)")
    for c, j in (("run", "left"), ("split", "left"), ("hours", "right"), ("steps / hour", "right"),
                 ("elastic's gain over it", "right")):
        t.add_column(c, justify=j)
    moved = " -> ".join([pred.start.label] + [pred.by_ratio(to).label for _, _, to in pred.moves])
    for run, name, split in (("start", "fixed, fastest at the start", pred.start.label),
                             ("hindsight", "fixed, fastest in hindsight", pred.hindsight.label),
                             ("elastic", f"elastic ({len(pred.moves)} move{'' if len(pred.moves) == 1 else 's'})", moved)):
        gain = "" if run == "elastic" else f"{100 * pred.gain_over(run):+.1f}%"
        t.add_row(name, split, f"{hours[run]:.2f}", f"{pred.steps_per_hour(run):.2f}", gain)
    console.print(t)
    p = Table(title="Steps / hour by phase (each simulated on its own part of the growing lengths)")
    for c in ("phase", "steps", "lengths x", "fastest split", "its steps / hour",
              "start split's", "elastic run's split(s)"):
        p.add_column(c, justify="left" if c in ("phase", "fastest split", "elastic run's split(s)") else "right")
    P, total = pred.phases, pred.total_steps
    for i, row in enumerate(pred.speeds):
        ok = {r: v for r, v in row.items() if v is not None}
        best = max(ok, key=ok.get) if ok else None
        lo, hi = total * i / P, total * (i + 1) / P
        at = [to for step, _, to in pred.moves if step <= lo][-1:] or [pred.start.ratio]
        at += [to for step, _, to in pred.moves if lo < step < hi]
        shown = " -> ".join(pred.by_ratio(r).label for r in at)
        start_v = row.get(pred.start.ratio)
        p.add_row(f"{i + 1}", f"{lo:.0f}-{hi:.0f}", f"{pred.growth ** (i / P):.3g}-{pred.growth ** ((i + 1) / P):.3g}",
                  pred.by_ratio(best).label if best else "-", f"{ok[best]:.2f}" if best else "-",
                  "-" if start_v is None else f"{start_v:.2f}", shown)
    console.print(p)
    console.print(f"a move stalls the run {pred.move_s:.0f} s (restart, checkpoint save and load, weight load; "
                  f"launcher/simulate/elastic.py)")
