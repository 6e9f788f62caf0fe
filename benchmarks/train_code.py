"""`make train-code` as a benchmark: wall time and held-out pass rate before and after RL.

The same measurement as benchmarks/train_math.py (`measure`), on `configs/code-tiny.yaml`:
the cached code warm-up, then 200 steps of RL whose rewards and evaluation run every program
in the reward sandbox. Writes train_code.json (where: benchmarks/common.py).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

from benchmarks.common import cli
from benchmarks.train_math import measure


def main(quick: bool = False) -> dict:
    return measure("code", quick)


if __name__ == "__main__":
    cli(main)
