"""LoRA against full fine-tuning on `make train-math` (issue 35): the same 200 steps from the same
warmed-up model and seed, once training the whole model (configs/math-tiny.yaml as shipped) and
once training LoRA adapters only, one after the other in one process.

Why: LoRA is only worth offering if it learns. The issue's bar is a held-out gain within 2
standard errors of full fine-tuning's over the same steps, or the gap measured and explained.
Adapters change the model less per step at the same learning rate (B starts at zero and only a
rank-r slice of each projection moves), so the LoRA run takes the usual LoRA learning rate, 10x
the full run's (`LORA`); the rank and alpha are stated with the figures.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import math

from benchmarks.common import cli, print_table, write_results
from benchmarks.train_math import run_once

LORA = ("trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.optim.lr=3.0e-4")


def _gain_se(r: dict) -> float:
    n = r["eval_n"]
    return math.sqrt(sum(r[k] * (1 - r[k]) / n for k in ("accuracy_before", "accuracy_after")))


def main(quick: bool = False) -> dict:
    full = run_once("math", quick, report=None)
    lora = run_once("math", quick, extra=LORA, report=None)
    keys = ("steps", "wall_s", "accuracy_before", "accuracy_after", "accuracy_gain_points", "trajectories_per_s")
    print_table("make train-math: full fine-tuning vs LoRA adapters",
                ["training", "steps", "wall s", "held-out before", "held-out after", "gain (points)", "trajectories/s"],
                [[name, *(r[k] for k in keys)] for name, r in (("full", full), ("LoRA r16", lora))])
    headline = {"full": full, "lora": lora, "lora_overrides": list(LORA)}
    if not quick:
        a, b = full["accuracy_after"], lora["accuracy_after"]
        se = math.sqrt(a * (1 - a) / full["eval_n"] + b * (1 - b) / lora["eval_n"])
        headline.update(after_gap_points=round(100 * (b - a), 1), after_gap_se_points=round(100 * se, 1),
                        after_gap_in_se=round((b - a) / se, 2) if se else None,
                        within_2_se=abs(b - a) <= 2 * se,
                        full_gain_se_points=round(100 * _gain_se(full), 1),
                        lora_gain_se_points=round(100 * _gain_se(lora), 1))
        print(f"after RL, LoRA minus full: {headline['after_gap_points']} points "
              f"(± {headline['after_gap_se_points']} s.e., {headline['after_gap_in_se']} s.e.)")
        write_results("lora_learning", headline)
    return headline


if __name__ == "__main__":
    cli(main)
