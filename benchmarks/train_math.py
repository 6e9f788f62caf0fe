"""`make train-math` as a benchmark: its wall time and held-out accuracy before and after RL
(`measure("code")` is `make train-code`, benchmarks/train_code.py).

Runs exactly what the Makefile target runs — the cached warm-up (`tandem sft --task math`,
trained once into .cache/) and `tandem run configs/math-tiny.yaml` (200 steps, eta 2, the
shipped defaults, CPU placement on) — in a scratch directory, and keeps the run's
`summary.json` figures: wall seconds, held-out greedy accuracy before and after (n = 500) with
their standard errors, the held-out curve of the run (`rollout.eval_every`), trajectories/s,
the staleness reached and what the run left for TensorBoard and W&B; the run's report is copied
beside them as `train_<task>_report.png` (with several seeds, the last seed's; into
benchmarks/results/ with `--record`, as the JSON). `--quick` runs 3 steps of an untrained model
to check the mechanics and writes nothing. `run_once(..., arch="qwen3_moe")` is the
mixture-of-experts twin, `make train-<task>-moe` (benchmarks/train_math_moe.py).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks.common import cli, output_path, print_table, write_results
from tandem.services.protocol import ExpDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]
# The tiny model's architecture (`tandem sft --arch`) -> the suffix of its Makefile target, experiment
# file and cached warm-up: make train-math-moe runs configs/math-moe-tiny.yaml from .cache/tiny-math-moe-sft.
VARIANTS = {"qwen2": "", "qwen3_moe": "-moe"}


def _tandem(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def main(quick: bool = False, overrides: tuple[str, ...] = ()) -> dict:
    return measure("math", quick, extra=tuple(overrides))


def run_once(task: str, quick: bool = False, seed: int | None = None, extra: tuple[str, ...] = (),
             report: str | None = "", arch: str = "qwen2", keep: Callable[[Path], dict] | None = None) -> dict:
    """`make train-<task>` in a scratch directory (`seed`: experiment.seed, else the config's;
    `extra`: more overrides, as `ARGS=` adds them): its summary's headline figures. The run's
    report is kept as `train_<task>_report.png`, or as `report` when named, or not at all (None).
    `arch`: the tiny model's architecture (VARIANTS: "qwen3_moe" is `make train-<task>-moe`);
    `keep(exp)`: more figures, read from the run's directory before it is removed."""
    target = task + VARIANTS[arch]
    config, name = ROOT / f"configs/{target}-tiny.yaml", target.replace("-", "_")
    arch_args = ("--arch", arch) if VARIANTS[arch] else ()
    with tempfile.TemporaryDirectory(prefix=f"tandem-train-{target}-") as tmp:
        exp = Path(tmp) / "run"
        if quick:
            model = Path(tmp) / "tiny"
            _tandem("model", "init-tiny", str(model), *arch_args)
            overrides = ["trainer.total_steps=3", "rollout.eval_size=8", "trainer.checkpoint_every=0"]
        else:
            model = ROOT / ".cache" / f"tiny-{target}-sft"
            _tandem("sft", "--task", task, *arch_args, "--out", str(model))
            overrides = []
        if seed is not None:
            overrides.append(f"experiment.seed={seed}")
        proc = _tandem("run", str(config), f"experiment.model={model}", f"experiment.exp_dir={exp}", *overrides, *extra)
        summary = json.loads((exp / "summary.json").read_text())
        if not quick and None in (summary["eval"]["before"], summary["eval"]["after"]):
            # a run whose evaluation failed has no figure to compare: say why, do not record it
            raise RuntimeError(f"the run finished but an evaluation failed:\n{proc.stderr[-3000:]}")
        seed = yaml.safe_load((exp / "config.yaml").read_text())["experiment"]["seed"]
        curve = [{"step": r["step"], "accuracy": r["eval_accuracy"], "se": r["eval_se"], "tag": r.get("tag"),
                  **({"first_turn_accuracy": r["eval_first_turn_accuracy"]} if "eval_first_turn_accuracy" in r else {})}
                 for r in read_metrics(ExpDir(exp), event="eval")]
        # What the run left for the user's trackers (the config names TensorBoard and W&B).
        trackers = {"tensorboard_event_files": len(list((exp / "tb").glob("events.out.tfevents.*"))),
                    "wandb_offline_runs": len(list((exp / "wandb").glob("offline-run-*")))}
        if not quick and report is not None:   # the run's report, beside its figures (docs/running.md shows it)
            shutil.copy(exp / "report" / "report.png", output_path(report or f"train_{name}_report.png"))
        kept = keep(exp) if keep is not None else {}
    ev = summary["eval"]
    se = {k: math.sqrt(ev[k] * (1 - ev[k]) / ev["n"]) if ev[k] is not None and ev["n"] else None
          for k in ("before", "after")}
    turns = {f"{k}_accuracy": ev[k] for k in ("first_turn_before", "first_turn_after") if k in ev}
    turns.update({f"{k}_mean": ev[k] for k in ("turns_before", "turns_after") if k in ev})
    rl_s = summary.get("rl_s")
    return {"seed": seed, "steps": summary["steps"], "wall_s": summary["wall_s"], "rl_s": rl_s,
            "rl_s_per_step": round(rl_s / summary["steps"], 2) if rl_s and summary["steps"] else None,
            "eval_n": ev["n"],
            "accuracy_before": ev["before"], "accuracy_after": ev["after"],
            "accuracy_gain_points": round(100 * (ev["after"] - ev["before"]), 1)
            if ev["before"] is not None and ev["after"] is not None else None,
            "accuracy_se_before": se["before"], "accuracy_se_after": se["after"],
            "trajectories_per_s": summary["throughput"]["trajectories_per_s"],
            "staleness_max": summary["staleness"]["max"], "groups_dropped_stale": summary["staleness"].get("dropped"),
            "held_out_curve": curve, **turns, **trackers, **kept}


def difference_se(a: float, n_a: int, b: float, n_b: int) -> float | None:
    """Standard error of the difference of two independent binomial accuracies (None without both)."""
    return math.sqrt(a * (1 - a) / n_a + b * (1 - b) / n_b) if n_a and n_b else None


def seed_means(runs: list[dict]) -> dict:
    """Mean gain over seeds, in points, with its standard error: each seed's gain has the binomial
    errors of its two evaluations; the seeds' evaluations are independent."""
    def mean_gain(before: str, after: str) -> tuple[float, float]:
        gains = [r[after] - r[before] for r in runs]
        var = sum(r[before] * (1 - r[before]) / r["eval_n"] + r[after] * (1 - r[after]) / r["eval_n"] for r in runs)
        return round(100 * sum(gains) / len(runs), 1), round(100 * math.sqrt(var) / len(runs), 1)

    gain, se = mean_gain("accuracy_before", "accuracy_after")
    out = {"seeds_gain_points": gain, "seeds_gain_se_points": se}
    if all("first_turn_before_accuracy" in r for r in runs):
        gain, se = mean_gain("first_turn_before_accuracy", "first_turn_after_accuracy")
        out.update(seeds_first_turn_gain_points=gain, seeds_first_turn_gain_se_points=se)
    return out


def measure(task: str, quick: bool = False, seeds: tuple[int, ...] = (), extra: tuple[str, ...] = ()) -> dict:
    """`make train-<task>`, once with the config's seed or once per seed of `seeds`: the headline
    figures of the first run, every run under `runs` and, for several seeds, the mean gains
    (`extra`: overrides, as `ARGS=` adds them)."""
    runs = [run_once(task, quick, s, extra) for s in seeds] if seeds else [run_once(task, quick, extra=extra)]
    if extra:
        print(f"overrides: {' '.join(extra)}")
    means = seed_means(runs) if len(runs) > 1 else {}
    headline = {**runs[0], **({"overrides": list(extra)} if extra else {}), **({"runs": runs, **means} if means else {})}
    print_table(f"make train-{task} (configs/{task}-tiny.yaml)", ["seed", "steps", "wall s", "RL s",
                "held-out before", "held-out after", "n", "trajectories/s"],
                [[r["seed"], r["steps"], r["wall_s"], r["rl_s"], r["accuracy_before"], r["accuracy_after"],
                  r["eval_n"], r["trajectories_per_s"]] for r in runs])
    if "first_turn_before_accuracy" in headline:
        print_table("first turn (before feedback), same problems", ["seed", "before", "after"],
                    [[r["seed"], r["first_turn_before_accuracy"], r["first_turn_after_accuracy"]] for r in runs])
    if means:
        print_table(f"mean over {len(runs)} seeds, points (± s.e.)", ["", "gain", "± s.e."],
                    [["after feedback" if "seeds_first_turn_gain_points" in means else "held-out",
                      means["seeds_gain_points"], means["seeds_gain_se_points"]]] +
                    ([["first turn", means["seeds_first_turn_gain_points"], means["seeds_first_turn_gain_se_points"]]]
                     if "seeds_first_turn_gain_points" in means else []))
    if not quick:
        write_results(f"train_{task.replace('-', '_')}", headline)
    return headline


def _args(p) -> list[str]:
    p.add_argument("overrides", nargs="*", help="config overrides, as ARGS= gives them to make train-math "
                   "(e.g. 'experiment.trackers=[jsonl,tensorboard]' where wandb is not installed)")
    return ["overrides"]


if __name__ == "__main__":
    cli(main, _args)
