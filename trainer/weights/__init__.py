"""Weight-sync methods on the trainer's side: one publisher per method (`trainer.weight_sync`).

`build_publisher` is the factory. Adding a method (CUDA IPC, bucketed NCCL) is one file here
with a `WeightPublisher` subclass and one line in `METHODS`, beside its message in
`services/protocol/control.py` and its applier in `services/controller/weights/`. Modules are
imported on use, so reading `METHODS` (config validation, the simulator) never imports torch.
"""
from __future__ import annotations

import importlib

from .base import BackgroundCall, Publication, WeightPublisher

# trainer.weight_sync value -> (module of this package, publisher class, how the simulator
# prices it: "filesystem" or "network"; see WeightPublisher.transfer_path).
METHODS: dict[str, tuple[str, str, str]] = {
    "disk": ("disk", "DiskPublisher", "filesystem"),
    "broadcast": ("broadcast", "BroadcastPublisher", "network"),
}


def transfer_path(method: str) -> str:
    """How the simulator prices `method` ("filesystem" or "network")."""
    if method not in METHODS:
        raise ValueError(f"trainer.weight_sync: unknown method {method!r} (known: {sorted(METHODS)})")
    return METHODS[method][2]


def publisher_class(method: str) -> type[WeightPublisher]:
    transfer_path(method)
    module, cls, _ = METHODS[method]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_publisher(tcfg, weights_root, receiver_ranks: int) -> WeightPublisher:
    """The publisher `tcfg.weight_sync` names. `receiver_ranks`: the generation servers' TP
    ranks in all (a broadcast group has 1 + that many members)."""
    return publisher_class(tcfg.weight_sync).from_config(tcfg, weights_root, receiver_ranks)


__all__ = ["METHODS", "BackgroundCall", "Publication", "WeightPublisher", "build_publisher", "publisher_class",
           "transfer_path"]
