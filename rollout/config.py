"""Config sections owned by the rollout package: `rollout` (workers) and `gen` (servers)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutConfig:
    # Samples generated per prompt (the group size n).
    n_samples: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 1024
    num_workers: int = 1
    # Episodes a worker runs concurrently.
    concurrency: int = 64

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.n_samples < 1:
            out.append(("n_samples", "must be >= 1"))
        if self.temperature <= 0:
            out.append(("temperature", "must be > 0"))
        if self.max_new_tokens < 1:
            out.append(("max_new_tokens", "must be >= 1"))
        return out


@dataclass
class GenConfig:
    # embedded: Tandem's CPU server; sglang: SGLang servers on GPUs (same HTTP API).
    backend: str = "embedded"
    num_servers: int = 1

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.backend not in ("embedded", "sglang"):
            out.append(("backend", f"must be 'embedded' or 'sglang', got {self.backend!r}"))
        if self.num_servers < 1:
            out.append(("num_servers", "must be >= 1"))
        return out
