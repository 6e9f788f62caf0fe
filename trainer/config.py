"""The trainer's part of the experiment config (section `trainer`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclass
class TrainerConfig:
    # B: prompt groups consumed per global training step (one policy version).
    groups_per_step: int = 16
    total_steps: int = 100
    # Optimizer updates per global step; each takes groups_per_step / ppo_n_minibatches groups.
    ppo_n_minibatches: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.groups_per_step < 1:
            out.append(("groups_per_step", "must be >= 1"))
        if self.ppo_n_minibatches < 1:
            out.append(("ppo_n_minibatches", "must be >= 1"))
        elif self.groups_per_step % self.ppo_n_minibatches:
            out.append(("ppo_n_minibatches",
                        f"groups_per_step={self.groups_per_step} is not divisible by "
                        f"ppo_n_minibatches={self.ppo_n_minibatches}"))
        if self.total_steps < 1:
            out.append(("total_steps", "must be >= 1"))
        if self.optim.lr <= 0:
            out.append(("optim.lr", "must be > 0"))
        return out
