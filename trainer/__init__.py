"""Replay buffer, advantages, decoupled PPO, micro-batching, backends, weight publishing.

The backend factory lives here, not in `trainer/backend.py`: the base module defines the
contract every backend imports, so a factory there that imports the backends back would make
`trainer.backend` and each backend an import cycle.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.trainer.backend import TrainBackend


def build_backend(cfg, model_dir: str | Path, seed: int, alive_micro_batches: int = 1) -> TrainBackend:
    """The backend named by `cfg.backend` (a `TrainerConfig`), loaded from a HF directory.

    Both constructors take `(cfg: TrainerConfig, model_dir: Path, seed: int)`. The caller has
    already initialised the default torch.distributed process group when the job has more than
    one rank (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a backend builds
    its own sub-groups from it (e.g. Megatron's parallel_state) and never re-initialises it.
    Imports are lazy so that `import trainer` loads neither torch model code nor Megatron.
    `alive_micro_batches`: what a Megatron pipeline keeps at once, for `trainer.megatron.recompute:
    auto` (trainer/recompute.py); the torch backend has no pipeline.
    """
    if cfg.backend == "torch":
        from tandem.trainer.torch_backend import TorchBackend
        return TorchBackend(cfg, Path(model_dir), seed)
    if cfg.backend == "megatron":
        from tandem.trainer.megatron.backend import MegatronBackend
        return MegatronBackend(cfg, Path(model_dir), seed, alive_micro_batches=alive_micro_batches)
    raise ValueError(f"trainer.backend: unknown backend {cfg.backend!r} (expected torch or megatron)")
