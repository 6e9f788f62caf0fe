"""`make train-code-agent` as a benchmark: the multi-turn code episode (rollout/code_feedback.py).

The same measurement as benchmarks/train_math.py (`measure`) on `configs/code-agent-tiny.yaml`:
the cached `code-agent` warm-up, then RL whose samples revise their programs from feedback on
the visible examples; held-out pass rate of the last turn and of the first, before and after,
on the same problems. Two seeds (experiment.seed 1 and 2), since single runs of the code task
differ by several points: the mean gain and its standard error are the headline. Writes
train_code_agent.json (where: benchmarks/common.py).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

from benchmarks.common import cli
from benchmarks.train_math import measure


def main(quick: bool = False) -> dict:
    return measure("code-agent", quick, seeds=(1,) if quick else (1, 2))


if __name__ == "__main__":
    cli(main)
