"""Weights on disk: `<exp>/weights/v<N>/`, a Hugging Face directory each server loads itself.

What the directory holds is the backend's choice (`export_hf`): the model, or, for a LoRA run
with `trainer.lora.sync: adapter`, peft's adapter directory, announced as `adapter_on_disk`: the
servers load it over /load_lora_adapter (services/controller/weights/adapter.py) and
`tandem export` merges it onto experiment.model.

It is written in a temp directory beside it and renamed into place, so a server told to load
v<N> never sees half a checkpoint; the last `keep` versions stay (a server still loading
v<N-1>, or one being caught up, must not find it deleted). Versions above the one just
published are an abandoned future (a launch that went further than the checkpoint a `--resume`
continues from): they are deleted too, or they would count as "newer" and push the fresh
versions out.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from tandem.services.protocol import AdapterOnDisk, WeightsOnDisk, numbered_dirs, remove_leftovers
from tandem.trainer.backend import TrainBackend

from .base import Publication, WeightPublisher


def weights_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def published_versions(root: Path) -> list[int]:
    return numbered_dirs(root, "v")


def stale_versions(versions: list[int], current: int, keep: int) -> list[int]:
    """What to delete after publishing `current`: everything above it, and all but the newest
    `keep` at or below it."""
    kept = [v for v in versions if v <= current][-keep:]
    return [v for v in versions if v not in kept]


class DiskPublisher(WeightPublisher):
    transfer_path = "filesystem"

    def __init__(self, root: Path, keep: int, adapter: bool = False):
        # adapter: the directories are LoRA adapters (trainer.lora.sync: adapter), announced as
        # adapter_on_disk so the servers swap the adapter they serve instead of loading a model.
        self.root, self.keep, self.adapter = Path(root), keep, adapter

    @classmethod
    def from_config(cls, tcfg, weights_root: Path, receiver_ranks: int) -> DiskPublisher:
        return cls(weights_root, tcfg.keep_weights, adapter=tcfg.lora.adapter_sync)

    def publish(self, backend: TrainBackend, version: int) -> Publication:
        """Export the model as `<root>/v<version>/` atomically; prune to the newest `keep` versions.

        Collective (every rank calls it; only rank 0 writes)."""
        root = self.root
        final = weights_dir(root, version)
        tmp = root / f".v{version}.tmp-{os.getpid()}"
        t0 = time.perf_counter()
        if backend.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(root, ".v*.tmp-*", ".v*.old-*")
        try:
            backend.export_hf(tmp)
            t1 = time.perf_counter()
            if backend.rank == 0:
                _fsync_tree(tmp)
                if final.exists():  # left by a run that crashed after publishing; this one replaces it
                    stale = root / f".v{version}.old-{os.getpid()}"
                    os.replace(final, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                os.replace(tmp, final)
                _fsync_dir(root)
        except BaseException:
            if backend.rank == 0:   # a model's worth of space (a full disk stops it, too)
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        t2 = time.perf_counter()
        if backend.rank == 0:
            for old in stale_versions(published_versions(root), version, self.keep):
                shutil.rmtree(weights_dir(root, old), ignore_errors=True)
        t3 = time.perf_counter()
        announce = AdapterOnDisk if self.adapter else WeightsOnDisk
        return Publication(announce(version=version, path=str(final)),
                           {"export_s": t1 - t0, "rename_s": t2 - t1, "prune_s": t3 - t2})


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_final(backend: TrainBackend, root: Path, version: int, keep: int) -> bool:
    """Collective: leave the run's final policy at `<root>/v<version>/` whatever the weight sync
    (with `broadcast` nothing was written there), so `tandem export` and `tandem eval` find the
    exact weights the run ended with (an adapter directory for `trainer.lora.sync: adapter`,
    which they merge onto the base model). Rank 0 decides (its view of the directory), so every rank
    takes the same branch. Returns whether it wrote them."""
    import torch

    from tandem.services.protocol import collectives

    missing = torch.tensor([float(backend.rank == 0 and not weights_dir(root, version).is_dir())])
    if backend.world_size > 1:
        collectives.all_reduce(missing, op=collectives.ReduceOp.MAX)
    if not missing.item():
        return False
    DiskPublisher(root, keep).publish(backend, version)
    return True
