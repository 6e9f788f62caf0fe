"""`make train-agent` against `make train-math`: does the model learn to use its tool, and does the
tool beat answering alone? (issue 64)

Runs both Makefile targets' runs in one process, one after the other, as benchmarks/train_math.py
measures one (`run_once`): the calculator agent (`configs/agent-math-tiny.yaml`, the cached
`agent-math` warm-up: one calculator call for every two direct answers) and the single-turn math
run without the tool (`configs/math-tiny.yaml`, the `math` warm-up), 200 steps each, the same
seed, the same held-out problems (n = 500, greedy). Reported: each run's held-out accuracy
before and after with the gain, the agent's model turns per held-out episode before and after
(2 = it calls the calculator, 1 = it answers at once), and the gap between the two runs' final
accuracies with its standard error (two independent binomial evaluations). Writes
train_agent.json (where: benchmarks/common.py).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401


from benchmarks.common import cli, print_table, write_results
from benchmarks.train_math import difference_se, run_once


def main(quick: bool = False) -> dict:
    agent = run_once("agent-math", quick, report=None)
    single = run_once("math", quick, report=None)
    keys = ("steps", "wall_s", "accuracy_before", "accuracy_after", "accuracy_gain_points", "trajectories_per_s")
    print_table("make train-agent (calculator) vs make train-math (no tool)",
                ["run", "steps", "wall s", "held-out before", "held-out after", "gain (points)", "trajectories/s"],
                [[name, *(r.get(k) for k in keys)] for name, r in (("agent + calculator", agent),
                                                                  ("single turn, no tool", single))])
    a, b = agent["accuracy_after"], single["accuracy_after"]
    gap_se = difference_se(a, agent["eval_n"], b, single["eval_n"])
    headline = {
        "agent": agent, "single_turn": single,
        "agent_gain_points": agent["accuracy_gain_points"],
        "agent_turns_before": agent.get("turns_before_mean"), "agent_turns_after": agent.get("turns_after_mean"),
        "after_gap_points": round(100 * (a - b), 1),
        "after_gap_se_points": round(100 * gap_se, 1) if gap_se else None,
        "wall_ratio_agent_to_single": round(agent["wall_s"] / single["wall_s"], 2),
    }
    print(f"agent: {agent['accuracy_before']:.1%} -> {a:.1%} ({headline['agent_gain_points']:+} points; turns per "
          f"episode {headline['agent_turns_before']} -> {headline['agent_turns_after']}); single turn: "
          f"{single['accuracy_before']:.1%} -> {b:.1%}; final gap {headline['after_gap_points']:+} points "
          f"(± {headline['after_gap_se_points']} s.e.); wall time ×{headline['wall_ratio_agent_to_single']}")
    if not quick:
        write_results("train_agent", headline)
    return headline


if __name__ == "__main__":
    cli(main)
