"""Asynchronous vs synchronous RL on the embedded default, in one run of this script.

The same workload (configs/math-tiny.yaml from the warmed-up tiny model) three times through
`tandem run`: eta = 0 (synchronous: generation waits for every update), eta = 4 with
interruptible generation, and eta = 4 with non-interruptible generation (a weight update waits
for in-flight requests). Reported: seconds per training step, trajectories per second, held-out
accuracy after, and the ratios the AReaL paper reports at cluster scale (2.77x; +12-17%).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
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
    steps_done = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
                  if '"event": "step"' in line]
    span = steps_done[-1]["time"] - steps_done[0]["time"]
    return {"s_per_step": span / max(1, len(steps_done) - 1),
            "trajectories_per_s": summary["throughput"]["trajectories_per_s"],
            "accuracy_before": summary["eval"]["before"], "accuracy_after": summary["eval"]["after"],
            "staleness_max": summary["staleness"]["max"], "wall_s": summary["wall_s"]}


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
    base, fast, slow = results["eta0"], results["eta4"], results["eta4_no_interrupt"]
    rows = [[name, r["s_per_step"], r["trajectories_per_s"], r["staleness_max"],
             r["accuracy_before"], r["accuracy_after"], r["wall_s"]] for name, r in results.items()]
    print_table(f"async vs sync, {steps} steps of configs/math-tiny.yaml",
                ["variant", "s/step", "trajectories/s", "max staleness", "acc before", "acc after", "wall s"], rows)
    headline = {
        "speedup_eta4_over_eta0": round(fast["trajectories_per_s"] / base["trajectories_per_s"], 3),
        "interruptible_gain": round(fast["trajectories_per_s"] / slow["trajectories_per_s"] - 1, 3),
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
