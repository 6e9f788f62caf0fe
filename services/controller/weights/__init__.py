"""Weight-sync methods on the controller's side: one applier per protocol message.

`build_appliers` is the factory: {message op: applier}. Adding a method (CUDA IPC, bucketed
NCCL) is one file here with a `WeightApplier` subclass, listed in `APPLIERS`, beside its
message in `services/protocol/control.py` and its publisher in `trainer/weights/`.
"""
from __future__ import annotations

from tandem.services.config import ControllerConfig

from .adapter import AdapterApplier
from .base import SyncResult, SyncRun, WeightApplier
from .broadcast import BroadcastApplier
from .disk import DiskApplier

APPLIERS: tuple[type[WeightApplier], ...] = (DiskApplier, BroadcastApplier, AdapterApplier)


def build_appliers(cfg: ControllerConfig) -> dict[str, WeightApplier]:
    """One applier per weight message, keyed by the message's op."""
    return {cls.message.OP: cls(cfg) for cls in APPLIERS}


__all__ = ["APPLIERS", "SyncResult", "SyncRun", "WeightApplier", "build_appliers"]
