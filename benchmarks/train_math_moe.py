"""`make train-math-moe` as a benchmark: a tiny Qwen3-MoE learns the synthetic math task by RL with
rollout routing replay on (issue 65).

Runs what the Makefile target runs, as benchmarks/train_math.py runs `make train-math`
(`run_once(..., arch="qwen3_moe")`): the cached warm-up `tandem sft --task math --arch qwen3_moe`
(8 experts, top 2, 4 layers, every layer sparse) and `tandem run configs/math-moe-tiny.yaml`
(200 steps, eta 2, `trainer.routing_replay: true`). Reported: held-out greedy accuracy before
and after (n = 500) with the gain and its standard error, wall time, and what the trainer's steps
logged of the routing: `moe_router_agreement` (the fraction of the sampler's recorded
token-layer top-k sets the trainer's own routers chose too: below 1 where the trainer's weights
have moved past the version that sampled, which is what replay corrects) and the mismatch
metrics of the tokens the trainer's current version sampled (`mismatch_k3`, the largest
importance ratio: with replay and float32 on both sides these are the sampler's own log-probs).
Writes train_math_moe.json and the run's report, train_math_moe_report.png (where:
benchmarks/common.py). `--quick` runs 3 steps of an untrained tiny MoE and writes nothing.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

from pathlib import Path

from benchmarks.common import cli, print_table, write_results
from benchmarks.train_math import difference_se, run_once
from tandem.services.protocol import ExpDir, read_metrics

CURVE_EVERY = 10   # steps between the points of the routing curve kept in the JSON


def router_figures(exp: Path) -> dict:
    """What the trainer's step records say of the routing over the run."""
    records = read_metrics(ExpDir(exp), "trainer", "step")
    agreement = [(r["step"], r["moe_router_agreement"]) for r in records if r.get("moe_router_agreement") is not None]
    k3 = [r["mismatch_k3"] for r in records if r.get("mismatch_k3") is not None]
    ratio_max = [r["mismatch_ratio_max"] for r in records if r.get("mismatch_ratio_max") is not None]
    values = [a for _, a in agreement]
    return {
        "steps_with_router_agreement": len(agreement),
        "router_agreement_mean": sum(values) / len(values) if values else None,
        "router_agreement_min": min(values, default=None),
        "router_agreement_first": values[0] if values else None,
        "router_agreement_last": values[-1] if values else None,
        "steps_with_mismatch": len(k3),
        "mismatch_k3_mean": sum(k3) / len(k3) if k3 else None,
        "mismatch_k3_max": max(k3, default=None),
        "mismatch_ratio_max": max(ratio_max, default=None),
        "router_curve": [{"step": r["step"], "router_agreement": r.get("moe_router_agreement"),
                          "mismatch_k3": r.get("mismatch_k3"), "groups_staleness_max":
                          max((int(k) for k in r.get("staleness_hist") or {}), default=None)}
                         for r in records if r["step"] % CURVE_EVERY == 0 or r["step"] == 1],
    }


def main(quick: bool = False) -> dict:
    run = run_once("math", quick, arch="qwen3_moe", keep=router_figures)
    gain_se = difference_se(run["accuracy_before"], run["eval_n"], run["accuracy_after"], run["eval_n"])
    headline = {**run, "accuracy_gain_se_points": round(100 * gain_se, 1) if gain_se is not None else None}
    print_table("make train-math-moe (configs/math-moe-tiny.yaml: tiny Qwen3-MoE, routing replay on)",
                ["steps", "wall s", "RL s", "held-out before", "held-out after", "gain (points)", "± s.e.", "n",
                 "trajectories/s"],
                [[run["steps"], run["wall_s"], run["rl_s"], run["accuracy_before"], run["accuracy_after"],
                  run["accuracy_gain_points"], headline["accuracy_gain_se_points"], run["eval_n"],
                  run["trajectories_per_s"]]])
    print_table("routing over the run's steps (trainer records)",
                ["steps", "agreement mean", "agreement min", "agreement first", "agreement last",
                 "mismatch k3 mean", "mismatch k3 max", "ratio max"],
                [[run["steps_with_router_agreement"], run["router_agreement_mean"], run["router_agreement_min"],
                  run["router_agreement_first"], run["router_agreement_last"], run["mismatch_k3_mean"],
                  run["mismatch_k3_max"], run["mismatch_ratio_max"]]])
    if not quick:
        write_results("train_math_moe", headline)
    return headline


if __name__ == "__main__":
    cli(main)
