"""The AReaL paper's staleness ablation (its Table 2 and Figure 5) in miniature.

The claim: with the behaviour policy as the proximal one ("naive PPO"), accuracy falls as the
staleness bound eta grows; with the decoupled objective, eta up to about 8 costs nothing. Stale
data only matters when the policy moves between versions, so the benchmark first measures how
far one update moves the tiny policy: a short decoupled run at each learning rate of LR_PROBE,
recording `version_kl` (the k3 estimate of KL(policy v-1 || policy v) on the policy's own
tokens, every step) and the held-out accuracy after. Then the grid: naive PPO
(`trainer.proximal=behaviour`) against decoupled PPO (`recompute`) at each eta of ETAS, SEEDS
seeds each, at GRID_LR — the largest probed rate at which the tiny policy still learns (at 3e-4
it moves about 1e-2 per version at times and collapses, decoupled at eta 1 included) — from the
same warmed-up tiny model, for the same number of trained steps, scored greedily on the same
held-out problems before and after. Generation must really outrun training for the bound to
matter: on this machine the trainer is the slower pool of `configs/math-tiny.yaml` (generation
and training on disjoint CPUs), and with the in-flight caps raised (IN_FLIGHT) the controller
keeps eta + 1 steps of groups in flight, so the trainer meets them up to eta versions late;
each cell reports the staleness its trained groups actually had and the per-version KL it saw.

Writes staleness_ablation.json (`probe` and `cells`, one per run) and staleness_ablation.png
(accuracy after RL against eta, one line per objective, ± 1 s.e.).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, output_path, print_table, write_results
from tandem.services.protocol import ExpDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/math-tiny.yaml"
LR_PROBE = (3e-5, 1e-4, 3e-4)   # the config's learning rate, and above it
# eta 1: the trained tokens are 0 or 1 version old, so version_kl (measured on tokens exactly one
# version old) exists at nearly every step; at a larger eta generation outruns training, groups
# wait whole in the buffer and arrive eta versions old, leaving none one version old.
PROBE_STEPS, PROBE_ETA = 20, 1
GRID_LR = 1e-4
ETAS = (0, 8, 16)
SEEDS = (1, 2, 3)
STEPS = 40
EVAL_N = 300
WARMUP = 5     # steps left out of the step time: the pipeline fills, first passes are cold
OBJECTIVES = {  # name -> overrides
    "naive": ["trainer.proximal=behaviour"],
    "decoupled": ["trainer.proximal=recompute"],
    "decoupled_loglinear": ["trainer.proximal=loglinear"],
}
# Every run: no held-out curve (the before/after figures are the measure), no checkpoints, the
# metrics file only.
COMMON = ["rollout.eval_every=0", "trainer.checkpoint_every=0", "experiment.trackers=[jsonl]"]
# Grid runs: eta the only limit on groups in flight, as in AReaL. The config's caps (32 groups, two steps
# of 16) limit the groups being generated, and so the versions one sequence's tokens span.
IN_FLIGHT = (max(ETAS) + 1) * 16   # groups: eta + 1 steps of the config's groups_per_step
UNCAPPED = [f"controller.max_concurrent_groups={IN_FLIGHT}", f"rollout.concurrency={IN_FLIGHT}"]


def tandem(*args: str, timeout: float = 3600) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def plan(quick: bool) -> list[tuple[str, int, int]]:
    """(objective, eta, seed) of every run of the grid."""
    if quick:
        return [("naive", 2, 1), ("decoupled", 2, 1), ("decoupled_loglinear", 2, 1)]
    return [(o, eta, s) for eta in ETAS for o in ("naive", "decoupled") for s in SEEDS]


def run_cell(objective: str, eta: int, seed: int, model: Path, workdir: Path, steps: int, eval_n: int,
             extra: list[str], lr: float) -> dict:
    exp = workdir / f"{objective}-eta{eta}-seed{seed}-lr{lr:g}"
    t0 = time.time()
    tandem("run", str(CONFIG), f"experiment.model={model}", f"experiment.exp_dir={exp}",
           f"experiment.seed={seed}", f"controller.max_staleness={eta}", f"trainer.total_steps={steps}",
           f"rollout.eval_size={eval_n}", f"trainer.optim.lr={lr}", *COMMON, *OBJECTIVES[objective], *extra)
    summary = json.loads((exp / "summary.json").read_text())
    trained = read_metrics(ExpDir(exp), "trainer", "step")
    hist = {int(k): v for k, v in trained[-1]["staleness_hist_total"].items()}
    tokens = {int(k): v for k, v in trained[-1].get("token_staleness_hist_total", {}).items()}
    measured = trained[WARMUP:] or trained
    span = measured[-1]["time"] - measured[0]["time"]
    ev = summary["eval"]
    n = ev["n"] or 1
    kls = [r["version_kl"] for r in trained if r.get("version_kl") is not None]
    return {"objective": objective, "eta": eta, "seed": seed, "lr": lr,
            "version_kl_median": statistics.median(kls) if kls else None, "version_kl_max": max(kls, default=None),
            "acc_before": ev["before"], "acc_after": ev["after"],
            "acc_se": math.sqrt(ev["after"] * (1 - ev["after"]) / n) if ev["after"] is not None else None,
            "eval_n": ev["n"],
            "mean_staleness": sum(k * v for k, v in hist.items()) / max(1, sum(hist.values())),
            "max_staleness": max(hist, default=0),
            "max_token_staleness": max(tokens, default=0),
            "share_at_eta": hist.get(eta, 0) / max(1, sum(hist.values())),
            "traj_per_s": sum(r.get("n_seqs", 0) for r in measured[1:]) / span if span else None,
            # The share of tokens whose ratio was clipped: with one minibatch a step, decoupled
            # PPO's ratio (against the proximal policy) is 1, so where naive PPO clips is the
            # only place the two objectives differ.
            "clip_fraction": sum(r.get("clip_fraction", 0) for r in trained) / len(trained),
            "step_s": sum(r.get("step_s", 0) for r in measured) / len(measured),
            "prox_s": sum(r.get("prox_s", 0) for r in measured) / len(measured),
            "wall_s": round(time.time() - t0, 1)}


def _mean_se(cells: list[dict]) -> tuple[float, float]:
    """Mean accuracy over seeds and its standard error: the larger of the binomial one (each
    seed's, combined) and the spread between seeds (their standard deviation / sqrt(n)), so
    neither the finite held-out set nor a seed's luck makes a difference look significant."""
    accs = [c["acc_after"] for c in cells]
    n = len(accs)
    mean = sum(accs) / n
    binomial = math.sqrt(sum(c["acc_se"] ** 2 for c in cells)) / n
    spread = math.sqrt(sum((a - mean) ** 2 for a in accs) / (n - 1) / n) if n > 1 else 0.0
    return mean, max(binomial, spread)


def plot(cells: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for objective, colour in (("naive", "tab:gray"), ("decoupled", "tab:red")):
        etas = sorted({c["eta"] for c in cells if c["objective"] == objective})
        pts = [_mean_se([c for c in cells if c["objective"] == objective and c["eta"] == e]) for e in etas]
        ax.errorbar(etas, [100 * m for m, _ in pts], yerr=[100 * s for _, s in pts], marker="o", capsize=4,
                    color=colour, label=f"{objective} PPO")
    before = [c["acc_before"] for c in cells if c["acc_before"] is not None]
    if before:
        ax.axhline(100 * sum(before) / len(before), color="black", linestyle=":", label="before RL")
    ax.set_xlabel("staleness bound eta")
    ax.set_ylabel("held-out accuracy after RL (%)")
    ax.set_xticks(sorted({c["eta"] for c in cells}))
    ax.set_title(f"staleness ablation at lr {cells[0]['lr']:g} ({cells[0]['eval_n']} held-out problems, mean of seeds ± 1 s.e.)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def probe(model: Path, workdir: Path) -> list[dict]:
    """How far one update moves the policy at each learning rate of LR_PROBE (decoupled PPO,
    PROBE_STEPS steps at eta PROBE_ETA): the per-version KL and what the run does to accuracy."""
    rows = []
    for lr in LR_PROBE:
        cell = run_cell("decoupled", PROBE_ETA, 1, model, workdir / "probe", PROBE_STEPS, EVAL_N, [], lr)
        print(f"probe lr={lr:g}: version KL median {cell['version_kl_median']}, max {cell['version_kl_max']}; "
              f"{cell['acc_before']:.3f} -> {cell['acc_after']:.3f} ({cell['wall_s']:.0f} s)", flush=True)
        rows.append(cell)
    print_table(f"per-version KL by learning rate (decoupled, eta {PROBE_ETA}, {PROBE_STEPS} steps)",
                ["lr", "version KL median", "max", "before", "after"],
                [[c["lr"], c["version_kl_median"], c["version_kl_max"], c["acc_before"], c["acc_after"]]
                 for c in rows])
    return rows


def main(quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-staleness-") as tmp:
        workdir = Path(tmp)
        if quick:
            model = workdir / "tiny"
            tandem("model", "init-tiny", str(model))
            steps, eval_n, lr = 3, 8, GRID_LR
            extra = ["trainer.groups_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=32"]
            probed = []
        else:
            model = ROOT / ".cache" / "tiny-math-sft"
            tandem("sft", "--task", "math", "--out", str(model))
            steps, eval_n, extra, lr = STEPS, EVAL_N, UNCAPPED, GRID_LR
            probed = probe(model, workdir)
        cells = []
        for objective, eta, seed in plan(quick):
            cell = run_cell(objective, eta, seed, model, workdir, steps, eval_n, extra, lr)
            print(f"{objective} eta={eta} seed={seed}: {cell['acc_before']:.3f} -> {cell['acc_after']:.3f}, "
                  f"staleness mean {cell['mean_staleness']:.2f} max {cell['max_staleness']}, version KL "
                  f"{cell['version_kl_median']}, {cell['step_s']:.2f} s/step ({cell['wall_s']:.0f} s)", flush=True)
            cells.append(cell)
    print_table(f"staleness ablation at lr {lr:g}: every run", ["objective", "eta", "seed", "before", "after",
                "± s.e.", "staleness mean", "max", "at eta", "version KL", "clipped", "traj/s", "s/step", "prox s"],
                [[c["objective"], c["eta"], c["seed"], c["acc_before"], c["acc_after"], c["acc_se"],
                  c["mean_staleness"], c["max_staleness"], c["share_at_eta"], c["version_kl_median"], c["clip_fraction"],
                  c["traj_per_s"], c["step_s"], c["prox_s"]] for c in cells])
    rows, summary = [], {}
    etas = sorted({c["eta"] for c in cells})
    for objective in OBJECTIVES:
        for eta in etas:
            group = [c for c in cells if c["objective"] == objective and c["eta"] == eta]
            if group:
                mean, se = _mean_se(group)
                step_s = sum(c["step_s"] for c in group) / len(group)
                stale = sum(c["mean_staleness"] for c in group) / len(group)
                rows.append([objective, eta, len(group), mean, se, stale, step_s])
                summary[f"{objective}_eta{eta}_acc_after"] = round(mean, 4)
                summary[f"{objective}_eta{eta}_se"] = round(se, 4)
                summary[f"{objective}_eta{eta}_step_s"] = round(step_s, 3)
    print_table("staleness ablation: mean over seeds", ["objective", "eta", "seeds", "after", "± s.e.",
                "mean staleness", "s/step"], rows)
    gaps = []
    for eta in etas:
        n, d = (summary.get(f"{o}_eta{eta}_acc_after") for o in ("naive", "decoupled"))
        if n is not None and d is not None:
            se = math.sqrt(summary[f"naive_eta{eta}_se"] ** 2 + summary[f"decoupled_eta{eta}_se"] ** 2)
            gaps.append([eta, d - n, se, (d - n) / se if se else None])
            summary[f"gap_eta{eta}_in_se"] = round((d - n) / se, 2) if se else None
    print_table("decoupled minus naive", ["eta", "accuracy gap", "s.e. of the gap", "gap / s.e."], gaps)
    headline = {"steps": steps, "eval_n": eval_n, "lr": lr, **summary, "probe": probed, "cells": cells}
    if not quick:
        plot(cells, output_path("staleness_ablation.png"))
        write_results("staleness_ablation", headline)
    return headline


if __name__ == "__main__":
    cli(main)
