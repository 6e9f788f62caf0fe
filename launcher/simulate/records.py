"""What a simulation takes (SimSetup) and what it returns (SimResult)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class SimulationError(Exception):
    """The configuration cannot run at all (e.g. one request does not fit a server's KV cache)."""


@dataclass
class SimSetup:
    num_servers: int
    groups_per_step: int
    n_samples: int
    eta: int
    max_concurrent_groups: int
    steps: int
    warmup_steps: int
    prompt_tokens: int
    max_new_tokens: int
    interruptible: bool = True
    # An interrupted request goes back to its rollout worker, which sends it again (the server
    # pays Costs.request_s once more: controller.interrupt_mode abort); false = the server keeps
    # it across the update and only re-prefills it (retract).
    resubmit_interrupted: bool = True
    # An interrupted request loses its KV cache and is re-prefilled (abort, retract); false = it
    # keeps the cache of the old weights and goes straight on (in_place).
    reprefill_interrupted: bool = True
    reward_s: float = 0.0
    # trainer.wait_for_ack: the trainer waits until every server holds the new version; else it
    # goes on and only its next publish waits for the previous version's loads.
    wait_for_ack: bool = True
    # trainer.checkpoint_every (0 = never): the trainer is busy Costs.checkpoint_s after those steps.
    checkpoint_every: int = 0
    # A rollout worker refused by the staleness bound asks again after controller.retry_after_s:
    # on average half of that passes between a new version and the next admissions.
    admit_delay_s: float = 0.0


@dataclass
class SimResult:
    steps_per_hour: float
    trajectories_per_s: float
    gen_tokens_per_s: float
    trained_tokens_per_s: float
    gen_utilization: float
    train_utilization: float
    mean_batch: float
    step_times: list[float]
    staleness: Counter = field(default_factory=Counter)
    token_staleness: Counter = field(default_factory=Counter)
    retractions: int = 0
    interrupts: int = 0
    events: int = 0

    @property
    def step_s(self) -> float:
        return 3600.0 / self.steps_per_hour
