"""Asynchronous vs synchronous RL on the embedded default, in one run of this script.

The same workload (configs/math-tiny.yaml from the warmed-up tiny model) three times through
`tandem run`: eta = 0 (synchronous: generation waits for every update), eta = 4 with
interruptible generation, and eta = 4 with non-interruptible generation (a weight update waits
for in-flight requests). Reported: seconds per training step, trajectories per second, held-out
accuracy after, and the ratios the AReaL paper reports at cluster scale (2.77x; +12-17%).

Then the simulator's check (issue: calibrated on these runs, it predicts the async/sync ratio
within 15%): `tandem simulate --calibrate` on each run's metrics predicts that run's seconds per
step, and the predicted ratios are compared with the measured ones. A second, harder prediction
uses only the synchronous run's costs for every variant: what a user would do before trying
asynchronous RL.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cli, print_table, write_results
from services.protocol import ExpDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]
# Steps left out of every average: the staleness pipeline fills (eta + 1 steps) and the first
# steps pay one-off costs (the first forward passes, a cold page cache).
WARMUP = 5
VARIANTS = {  # name -> overrides
    "eta0": ["controller.max_staleness=0"],
    "eta4": ["controller.max_staleness=4"],
    "eta4_no_interrupt": ["controller.max_staleness=4", "controller.interruptible=false"],
}


def tandem(*args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def run_variant(name: str, overrides: list[str], model: Path, workdir: Path, steps: int, eval_n: int) -> dict:
    exp = workdir / name
    tandem("run", "configs/math-tiny.yaml", f"experiment.model={model}", f"experiment.exp_dir={exp}",
           f"trainer.total_steps={steps}", f"rollout.eval_size={eval_n}", *overrides, timeout=3600)
    summary = json.loads((exp / "summary.json").read_text())
    steps_done = [r for r in read_metrics(ExpDir(exp), "trainer") if r.get("event") == "step"]
    warm = min(WARMUP, len(steps_done) - 2)
    span = steps_done[-1]["time"] - steps_done[warm]["time"]
    return {"s_per_step": span / max(1, len(steps_done) - 1 - warm),
            "trajectories_per_s": summary["throughput"]["trajectories_per_s"],
            "accuracy_before": summary["eval"]["before"], "accuracy_after": summary["eval"]["after"],
            "staleness_max": summary["staleness"]["max"], "wall_s": summary["wall_s"]}


def predict_s_per_step(variant: str, run: Path, calibration, steps: int) -> float:
    """The simulator's seconds per step for `variant`, with `run`'s fitted costs and lengths."""
    from launcher.config import load_config
    from launcher.simulate.scenario import simulate
    groups = [r for r in read_metrics(ExpDir(run), "rollout") if r.get("event") == "group"]
    prompt = round(sum(g["prompt_tokens"] for g in groups) / len(groups))
    cfg = load_config(ROOT / "configs/math-tiny.yaml", [
        *VARIANTS[variant], f"simulate.output_lengths=empirical:{run}",
        f"simulate.prompt_tokens={prompt}", f"simulate.warmup_steps={WARMUP}",
        f"simulate.steps={max(1, steps - WARMUP)}"])
    _, result = simulate(cfg, calibration)
    return result.step_s


def main(quick: bool = False) -> dict:
    steps, eval_n = (3, 16) if quick else (60, 300)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        work = Path(tmp)
        if quick:  # the mechanics only: an untrained model, a few steps
            model = work / "tiny"
            tandem("model", "init-tiny", str(model), timeout=300)
        else:
            model = ROOT / ".cache" / "tiny-math-sft"
            tandem("sft", "--task", "math", "--out", str(model), timeout=3600)
        results = {name: run_variant(name, ov, model, work, steps, eval_n) for name, ov in VARIANTS.items()}
        from launcher.simulate.calibrate import calibrate
        fitted = {name: calibrate(work / name) for name in results}
        for name, r in results.items():
            r["sim_s_per_step"] = predict_s_per_step(name, work / name, fitted[name], steps)
            r["sim_from_eta0_s_per_step"] = predict_s_per_step(name, work / "eta0", fitted["eta0"], steps)
    base, fast, slow = results["eta0"], results["eta4"], results["eta4_no_interrupt"]
    rows = [[name, r["s_per_step"], r["sim_s_per_step"], r["sim_from_eta0_s_per_step"], r["trajectories_per_s"],
             r["staleness_max"], r["accuracy_before"], r["accuracy_after"], r["wall_s"]]
            for name, r in results.items()]
    print_table(f"async vs sync, {steps} steps of configs/math-tiny.yaml (s/step after {WARMUP} warm-up steps)",
                ["variant", "s/step", "simulated (own run)", "simulated (eta0 run)", "trajectories/s",
                 "max staleness", "acc before", "acc after", "wall s"], rows)

    def ratios(key: str) -> tuple[float, float]:  # (async speed-up, interruptible gain)
        return base[key] / fast[key], slow[key] / fast[key] - 1

    measured, own, cross = ratios("s_per_step"), ratios("sim_s_per_step"), ratios("sim_from_eta0_s_per_step")
    print_table("ratios: measured vs simulated", ["ratio", "measured", "simulated (own run)", "error",
                                                  "simulated (eta0 run)", "error"],
                [["eta4 over eta0 speed-up", measured[0], own[0], own[0] / measured[0] - 1,
                  cross[0], cross[0] / measured[0] - 1],
                 # the gain's error as the error of (1 + gain), the ratio of the two speeds
                 ["interruptible gain", measured[1], own[1], (1 + own[1]) / (1 + measured[1]) - 1,
                  cross[1], (1 + cross[1]) / (1 + measured[1]) - 1]])
    headline = {
        "speedup_eta4_over_eta0": round(measured[0], 3),
        "interruptible_gain": round(measured[1], 3),
        # The simulator, calibrated on each run's own metrics, and on the synchronous run's only.
        "sim_speedup_eta4_over_eta0": round(own[0], 3),
        "calibrated_error_async_over_sync": round(own[0] / measured[0] - 1, 3),
        "sim_interruptible_gain": round(own[1], 3),
        "sim_from_eta0_speedup_eta4_over_eta0": round(cross[0], 3),
        "calibrated_from_eta0_error_async_over_sync": round(cross[0] / measured[0] - 1, 3),
        "sim_from_eta0_interruptible_gain": round(cross[1], 3),
        "accuracy_eta0": base["accuracy_after"], "accuracy_eta4": fast["accuracy_after"],
        "accuracy_start": base["accuracy_before"], "steps": steps, "eval_n": eval_n,
        **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items() if k != "accuracy_before"},
    }
    print(f"speed-up eta=4 over eta=0: {headline['speedup_eta4_over_eta0']}x; "
          f"interruptible generation: {100 * headline['interruptible_gain']:+.1f}%")
    if not quick:
        write_results("async_vs_sync", headline)
    return headline


if __name__ == "__main__":
    cli(main)
