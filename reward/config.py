"""The reward service's part of the experiment config (section `reward`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    # math | code
    task: str = "math"
    correct_reward: float = 5.0
    wrong_reward: float = -5.0
    num_workers: int = 2

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.task not in ("math", "code"):
            out.append(("task", f"must be 'math' or 'code', got {self.task!r}"))
        if self.num_workers < 1:
            out.append(("num_workers", "must be >= 1"))
        return out
