"""The controller's part of the experiment config (section `controller`)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import II


@dataclass
class ControllerConfig:
    # eta: training data is never more than this many policy versions stale; 0 = synchronous RL.
    max_staleness: int = 4
    # B, prompt groups per training step; owned by the trainer, mirrored here for admission.
    groups_per_step: int = II("trainer.groups_per_step")
    # Upper bound on groups generating at once, whatever the staleness budget allows.
    max_concurrent_groups: int = 256
    # A group whose worker has not heartbeated for this long is failed and its slot released.
    lease_s: float = 30.0
    host: str = "127.0.0.1"
    # 0 = pick a free port and publish it in <exp>/services/controller.json.
    port: int = 0

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.max_staleness < 0:
            out.append(("max_staleness", "must be >= 0 (0 means synchronous RL)"))
        if self.max_concurrent_groups < 1:
            out.append(("max_concurrent_groups", "must be >= 1"))
        if self.lease_s <= 0:
            out.append(("lease_s", "must be > 0"))
        return out
