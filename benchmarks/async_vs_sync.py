"""Asynchronous vs synchronous RL on the embedded default, in one run of this script.

Two workloads, each run through `tandem run` with the local launcher's CPU placement
(generation and training on disjoint cores, as on a cluster's disjoint GPUs):
- `default`: configs/math-tiny.yaml from the warmed-up tiny model (answers of ~31 tokens; the
  trainer is the slower pool);
- `long_tail`: the same, with every sample's length drawn from a skewed distribution up to 448
  tokens (benchmarks/long_tail.py), where generation is the bottleneck and a synchronous step
  waits for its longest sample.
Each in five modes: eta = 0 (synchronous); eta = 4 with the shipped default
`controller.interrupt_mode=in_place` (in-flight requests keep their KV cache across the update
and go on under the new weights); eta = 4 `retract` (they stay on the server and are
re-prefilled under the new weights); eta = 4 `abort` (they go back to their rollout worker and
are resubmitted); and eta = 4 non-interruptible (an update waits for in-flight requests).
Reported per variant: seconds per training step and trajectories per second after the warm-up,
held-out accuracy (default workload), staleness, and the CPU seconds of every role
(`<exp>/role_cpu.json`).

Then the simulator's check: `tandem simulate --calibrate` on each workload's synchronous run
alone predicts every variant of that workload (what a user would do before trying asynchronous
RL), and on each run's own metrics predicts that run; `sim_costs_from` says which run and which
metrics every cost came from.

`--repeats N` runs all ten variants N times, one round after another (so a slow hour of the
machine falls on every variant alike), and reports each figure as the median over the rounds,
with every round's seconds per step beside it: two single runs of the same code here differ by
up to 22% on one variant, twice the simulator's 10% target. Each round's simulation uses that
round's own runs; the held-out accuracy is measured in the first round only.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import contextlib
import copy
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cli, print_table, write_results
from tandem.services.protocol import ExpDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/math-tiny.yaml"
# Steps left out of every average: the staleness pipeline fills (eta + 1 steps) and the first
# steps pay one-off costs (the first forward passes, a cold page cache).
WARMUP = 5
WORKLOADS = {  # name -> (variant prefix, overrides)
    "default": ("", []),
    "long_tail": ("long_tail_", ["rollout.workflow=benchmarks.long_tail:episode", "rollout.max_new_tokens=448"]),
}
MODES = {  # name -> overrides
    "eta0": ["controller.max_staleness=0"],
    # the shipped default: interrupt_mode in_place
    "eta4": ["controller.max_staleness=4"],
    "eta4_retract": ["controller.max_staleness=4", "controller.interrupt_mode=retract"],
    "eta4_abort": ["controller.max_staleness=4", "controller.interrupt_mode=abort"],
    "eta4_no_interrupt": ["controller.max_staleness=4", "controller.interruptible=false"],
}
VARIANTS = {f"{prefix}{mode}": (workload, [*ov, *mov])
            for workload, (prefix, ov) in WORKLOADS.items() for mode, mov in MODES.items()}
# The quick path checks the mechanics only: small steps of an untrained model, short answers.
QUICK = ["trainer.groups_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=32",
         "trainer.checkpoint_every=0"]
QUICK_LONG_TAIL = ["rollout.max_new_tokens=96"]


def require_interrupt_mode() -> None:
    """The retract variants need `controller.interrupt_mode` (issue 13); fail before any run."""
    from tandem.launcher.config import ConfigError, load_config
    for mode in ("abort", "retract", "in_place"):
        try:
            load_config(CONFIG, [f"controller.interrupt_mode={mode}"])
        except ConfigError as e:
            raise SystemExit(f"benchmarks.async_vs_sync: controller.interrupt_mode={mode} is not accepted by "
                             f"this checkout ({e}); the eta4 and eta4_retract variants set it (issue 13: server-side "
                             f"retract)") from None


def tandem(*args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def overrides_for(name: str, quick: bool) -> list[str]:
    workload, ov = VARIANTS[name]
    if not quick:
        return ov
    return [*ov, *QUICK, *(QUICK_LONG_TAIL if workload == "long_tail" else [])]


def run_variant(name: str, model: Path, workdir: Path, steps: int, eval_n: int, quick: bool) -> dict:
    exp = workdir / name
    # No held-out curve (math-tiny.yaml scores 200 problems every 25 versions, eval_every_size, so
    # even with eval_size 0): those answers would be generated inside the measured steps, which
    # each mode absorbs differently. Before and after (eval_size) is outside them.
    tandem("run", str(CONFIG), f"experiment.model={model}", f"experiment.exp_dir={exp}",
           f"trainer.total_steps={steps}", f"rollout.eval_size={eval_n}", "rollout.eval_every=0",
           *overrides_for(name, quick), timeout=3600)
    summary = json.loads((exp / "summary.json").read_text())
    steps_done = read_metrics(ExpDir(exp), "trainer", "step")
    warm = max(0, min(WARMUP, len(steps_done) - 2))
    span = steps_done[-1]["time"] - steps_done[warm]["time"]
    measured = steps_done[warm + 1:]
    role_cpu = json.loads((exp / "role_cpu.json").read_text()) if (exp / "role_cpu.json").exists() else {}
    cpu = role_cpu.get("cpu_seconds", {})
    generated = sum(len(r.get("output_tokens", [])) for r in read_metrics(ExpDir(exp), "rollout")
                    if r.get("event") == "group")
    # Each pool's own speed, apart from waiting: when both pools run at once (eta > 0) they share
    # the machine's memory bandwidth and caches, which no calibration at eta 0 can see.
    trained = [r for r in measured if r.get("train_tokens") and r.get("train_step_s")]
    windows = [r for r in read_metrics(ExpDir(exp), "gen") if r.get("event") == "gen_window" and r.get("gen_steps")]
    decode_steps = sum(r["gen_steps"] for r in windows)
    # The light services share the generation CPU: their cost per trajectory should not depend
    # on eta, or a synchronous calibration would not carry over (docs/plan.md).
    services = sum(v for k, v in cpu.items() if k.split("-")[0] in ("controller", "reward", "rollout"))
    return {"services_cpu_ms_per_trajectory": 1e3 * services / generated if generated and cpu else None,
            "s_per_step": span / max(1, len(measured)),
            "trajectories_per_s": sum(r.get("n_seqs", 0) for r in measured) / span if span else None,
            "trajectories_per_s_whole_run": summary["throughput"]["trajectories_per_s"],
            "accuracy_before": summary["eval"]["before"], "accuracy_after": summary["eval"]["after"],
            "eval_n": summary["eval"]["n"], "staleness_max": summary["staleness"]["max"],
            "wall_s": summary["wall_s"], "role_cpu_s": cpu,
            "train_us_per_token": 1e6 * sum(r["train_step_s"] for r in trained) / sum(r["train_tokens"] for r in trained)
            if trained else None,
            "decode_us_per_token": 1e6 * sum(r["gen_decode_s"] for r in windows)
            / sum(r["gen_running"] * r["gen_steps"] for r in windows) if decode_steps else None}


def pools_vs_fit(fit, run: Path) -> dict:
    """How much slower (> 0) each pool of `run` worked than `fit`, the eta-0 run's calibration,
    prices the same work: decode at the run's own forward passes, rows and padded entries (the
    embedded server's `gen_decode_moments`), the trainer at its own token counts. At eta 0 the
    pools never overlap; above it they run at once, on one machine's shared memory bandwidth
    and caches (or in a slower hour of it). That shows here, and in no calibration of the eta-0
    run: what the simulator from eta 0 cannot know."""
    decode = [0.0, 0.0]
    train = [0.0, 0.0]
    for r in read_metrics(ExpDir(run)):
        m = r.get("gen_decode_moments")
        if r.get("event") == "gen_window" and isinstance(m, dict) and m.get("1"):
            decode[0] += m["t"]
            decode[1] += fit.d0 * m["f"] + fit.d1 * m["n"] + fit.d2 * m["p"]
        elif r.get("role") == "trainer" and r.get("event") == "step" and r.get("train_tokens") and r.get("train_step_s"):
            train[0] += r["train_step_s"]
            train[1] += fit.t0 + fit.t1 * r["train_tokens"]
    return {"decode_vs_eta0_fit": decode[0] / decode[1] - 1 if decode[1] else None,
            "train_vs_eta0_fit": train[0] / train[1] - 1 if train[1] else None}


def at_pool_speeds(fit, pools: dict):
    """`fit` with its decode costs scaled by a run's `decode_vs_eta0_fit` and its trainer costs
    by `train_vs_eta0_fit`: simulated from eta 0 so, a variant's error is the simulator's rules'
    alone, its pools' speed taken from the run itself (a diagnostic, not a prediction)."""
    out = copy.copy(fit)
    kd, kt = 1 + (pools["decode_vs_eta0_fit"] or 0.0), 1 + (pools["train_vs_eta0_fit"] or 0.0)
    out.d0, out.d1, out.d2, out.t0, out.t1 = fit.d0 * kd, fit.d1 * kd, fit.d2 * kd, fit.t0 * kt, fit.t1 * kt
    return out


def predict_s_per_step(variant: str, run: Path, calibration, steps: int, quick: bool) -> float:
    """The simulator's seconds per step for `variant`, with `run`'s fitted costs and lengths."""
    from tandem.launcher.config import load_config
    from tandem.launcher.simulate.scenario import simulate
    groups = [r for r in read_metrics(ExpDir(run), "rollout") if r.get("event") == "group"]
    prompt = round(sum(g["prompt_tokens"] for g in groups) / len(groups))
    cfg = load_config(CONFIG, [
        *overrides_for(variant, quick), f"simulate.output_lengths=empirical:{run}",
        f"simulate.prompt_tokens={prompt}", f"simulate.warmup_steps={WARMUP}",
        f"simulate.steps={max(1, steps - WARMUP)}"])
    _, result = simulate(cfg, calibration)
    return result.step_s


def _std_error(p: float | None, n: int) -> float | None:
    return math.sqrt(p * (1 - p) / n) if p is not None and n else None


def _ratios(results: dict, prefix: str, key: str) -> dict:
    """Speed-up of each asynchronous mode over eta 0, and gain of each interrupting mode over
    draining (non-interruptible), from seconds per step (`*s_per_step`) or a rate."""
    speed = {m: results[prefix + m][key] for m in MODES}
    if key.endswith("s_per_step"):
        speed = {m: 1 / v for m, v in speed.items()}
    return {"speedup_eta4_over_eta0": speed["eta4"] / speed["eta0"],
            "speedup_eta4_retract_over_eta0": speed["eta4_retract"] / speed["eta0"],
            "speedup_eta4_abort_over_eta0": speed["eta4_abort"] / speed["eta0"],
            "speedup_eta4_no_interrupt_over_eta0": speed["eta4_no_interrupt"] / speed["eta0"],
            "interruptible_gain": speed["eta4"] / speed["eta4_no_interrupt"] - 1,
            "retract_gain": speed["eta4_retract"] / speed["eta4_no_interrupt"] - 1,
            "abort_gain": speed["eta4_abort"] / speed["eta4_no_interrupt"] - 1}


def _error(key: str, predicted: float, measured: float) -> float:
    """Relative error of a predicted ratio; of a gain, the error of (1 + gain), the speed ratio."""
    if key.startswith("speedup"):
        return predicted / measured - 1
    return (1 + predicted) / (1 + measured) - 1


FIRST_ROUND_ONLY = ("accuracy_before", "accuracy_after", "eval_n")


def median_of_rounds(rounds: list[dict]) -> dict:
    """One variant's rounds as one result: each figure the median over the rounds where every
    round has a number, staleness the worst round, the rest (the held-out accuracy and the CPU
    seconds, measured in the first round only) as the first round gave them."""
    out = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if key in FIRST_ROUND_ONLY or not numeric:
            out[key] = first
        else:
            out[key] = max(values) if key == "staleness_max" else statistics.median(values)
    if len(rounds) > 1:
        per_step = [r["s_per_step"] for r in rounds]
        out["s_per_step_rounds"] = [round(v, 4) for v in per_step]
        out["s_per_step_spread"] = (max(per_step) - min(per_step)) / statistics.median(per_step)
    return out


@contextlib.contextmanager
def kept_on_failure(prefix: str):
    """A scratch directory removed after a complete benchmark and kept when anything fails: ten
    runs are half an hour, never to be lost to a late error."""
    path = tempfile.mkdtemp(prefix=prefix)
    print(f"runs in {path} (kept if the benchmark fails)", flush=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def main(quick: bool = False, repeats: int = 1) -> dict:
    if repeats < 1:
        raise SystemExit(f"benchmarks.async_vs_sync: --repeats must be at least 1, got {repeats}")
    require_interrupt_mode()
    # Loaded before the half-hour of runs, so the analysis uses the code the runs used.
    from tandem.launcher.simulate.calibrate import calibrate
    from tandem.launcher.simulate.scenario import simulate  # noqa: F401  (predict_s_per_step's import)
    steps, eval_n = (3, 8) if quick else (40, 300)
    # Held-out accuracy where it means something: the default workload's eta 0 and eta 4 (in
    # --quick, eta 0 only: each evaluation starts two more processes).
    evaluated = ("eta0",) if quick else ("eta0", "eta4")
    with kept_on_failure("tandem-bench-") as tmp:
        work = Path(tmp)
        if quick:  # the mechanics only: an untrained model, a few steps
            model = work / "tiny"
            tandem("model", "init-tiny", str(model), timeout=300)
        else:
            model = ROOT / ".cache" / "tiny-math-sft"
            tandem("sft", "--task", "math", "--out", str(model), timeout=3600)
        rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        sources = {}
        for i in range(repeats):
            runs = work / f"round{i}"
            for name in VARIANTS:
                r = run_variant(name, model, runs, steps, eval_n if i == 0 and name in evaluated else 0, quick)
                rounds[name].append(r)
                print(f"round {i + 1}/{repeats} {name}: {r['s_per_step']:.3f} s/step", flush=True)
            fitted = {name: calibrate(runs / name) for name in VARIANTS}
            for workload, (prefix, _) in WORKLOADS.items():
                sync = prefix + "eta0"
                if i == 0:
                    sources[workload] = {"run": sync, **fitted[sync].provenance,
                                         "placement": fitted[sync].placement, "notes": fitted[sync].notes}
                for mode in MODES:
                    name = prefix + mode
                    r = rounds[name][i]
                    r["sim_s_per_step"] = predict_s_per_step(name, runs / name, fitted[name], steps, quick)
                    r["sim_from_eta0_s_per_step"] = predict_s_per_step(name, runs / sync, fitted[sync], steps, quick)
                    r.update(pools_vs_fit(fitted[sync], runs / name))
                    r["sim_from_eta0_at_its_pool_speeds_s_per_step"] = predict_s_per_step(
                        name, runs / sync, at_pool_speeds(fitted[sync], r), steps, quick)
        results = {name: median_of_rounds(rs) for name, rs in rounds.items()}
    rows = [[name, r["s_per_step"], r["sim_s_per_step"], r["sim_from_eta0_s_per_step"], r["trajectories_per_s"],
             r["staleness_max"], r["accuracy_before"], r["accuracy_after"], r["wall_s"]]
            for name, r in results.items()]
    print_table(f"async vs sync, {steps} steps of configs/math-tiny.yaml (rates after the first "
                f"{min(WARMUP, steps - 2)} steps)",
                ["variant", "s/step", "simulated (own run)", "simulated (eta0 run)", "trajectories/s",
                 "max staleness", "acc before", "acc after", "wall s"], rows)
    print_table("each pool's own speed (busy time only), and how much slower than the eta 0 run's fit prices "
                "the same work (> 0: the pools slowed each other, or the machine was slower)",
                ["variant", "train us/token", "decode us/token", "train vs eta0 fit", "decode vs eta0 fit"],
                [[name, r["train_us_per_token"], r["decode_us_per_token"], r["train_vs_eta0_fit"],
                  r["decode_vs_eta0_fit"]] for name, r in results.items()])
    if repeats > 1:
        print_table(f"seconds per step in each of {repeats} rounds (the figures above are their medians)",
                    ["variant", *(f"round {i + 1}" for i in range(repeats)), "spread (max-min)/median"],
                    [[name, *r["s_per_step_rounds"], r["s_per_step_spread"]] for name, r in results.items()])
    headline: dict = {"steps": steps, "eval_n": eval_n, "warmup_steps": WARMUP, "rounds": repeats}
    for workload, (prefix, _) in WORKLOADS.items():
        tag = "" if workload == "default" else f"{workload}_"
        measured = _ratios(results, prefix, "s_per_step")
        by_traj = _ratios(results, prefix, "trajectories_per_s")
        own = _ratios(results, prefix, "sim_s_per_step")
        cross = _ratios(results, prefix, "sim_from_eta0_s_per_step")
        paced = _ratios(results, prefix, "sim_from_eta0_at_its_pool_speeds_s_per_step")
        table = []
        for key, value in measured.items():
            headline[f"{tag}{key}"] = round(value, 3)
            headline[f"{tag}trajectories_{key}"] = round(by_traj[key], 3)
            headline[f"{tag}sim_{key}"] = round(own[key], 3)
            headline[f"{tag}sim_from_eta0_{key}"] = round(cross[key], 3)
            own_err, cross_err = _error(key, own[key], value), _error(key, cross[key], value)
            paced_err = _error(key, paced[key], value)
            headline[f"{tag}sim_from_eta0_error_{key}"] = round(cross_err, 3)
            headline[f"{tag}sim_error_{key}"] = round(own_err, 3)
            headline[f"{tag}sim_from_eta0_at_its_pool_speeds_error_{key}"] = round(paced_err, 3)
            table.append([key, value, own[key], own_err, cross[key], cross_err, paced_err])
        print_table(f"{workload}: measured vs simulated", ["ratio", "measured", "simulated (own run)", "error",
                                                           "simulated (eta0 run)", "error",
                                                           "error, eta0 run at the variant's pool speeds"], table)
    base, fast = results["eta0"], results["eta4"]
    se0, se4 = _std_error(base["accuracy_after"], base["eval_n"]), _std_error(fast["accuracy_after"], fast["eval_n"])
    headline.update({
        "accuracy_start": base["accuracy_before"], "accuracy_eta0": base["accuracy_after"],
        "accuracy_eta4": fast["accuracy_after"], "accuracy_se_eta0": se0, "accuracy_se_eta4": se4,
        # eta 4 no worse than eta 0 within one standard error (of the difference)
        "accuracy_eta4_within_1se_of_eta0": (None if se0 is None or se4 is None else
                                             fast["accuracy_after"] >= base["accuracy_after"] - math.hypot(se0, se4)),
        "sim_costs_from": sources,
        **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items() if k != "accuracy_before"},
    })
    print(f"speed-up eta=4 over eta=0: {headline['speedup_eta4_over_eta0']}x (long tail "
          f"{headline['long_tail_speedup_eta4_over_eta0']}x); interruptible generation "
          f"{100 * headline['interruptible_gain']:+.1f}% (long tail {100 * headline['long_tail_interruptible_gain']:+.1f}%), "
          f"retract {100 * headline['retract_gain']:+.1f}% (long tail {100 * headline['long_tail_retract_gain']:+.1f}%), "
          f"abort {100 * headline['abort_gain']:+.1f}% (long tail {100 * headline['long_tail_abort_gain']:+.1f}%)")
    if not quick:
        write_results("async_vs_sync", headline)
    return headline


def add_args(parser) -> list[str]:
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="run all ten variants N times and report medians (about 20 min a round here)")
    return ["repeats"]


if __name__ == "__main__":
    cli(main, add_args)
