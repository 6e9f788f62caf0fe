"""Checkpoints the trainer resumes from: `<exp>/checkpoints/step-<N>/`, complete or absent.

Every rank writes its own `rank-<r>.pt` (its share of model and optimizer, its RNG states) into
a temp directory; rank 0 adds the loop state (version, counters, staleness histogram and the
unconsumed replay buffer) and renames the directory into place after every rank is done. A
crash at any moment leaves either the previous checkpoints or the new one, never a half one,
and `latest()` only ever sees complete directories.

Backends with sharded checkpoints (`TrainBackend.sharded_checkpoint`, the Megatron backend)
write model and optimizer as one collective directory `dist/` inside the same temp directory
(Megatron's dist checkpointing: every tensor with its global offsets, so it loads into another
tensor/pipeline/data-parallel layout); their rank files then hold only the RNG states, and a
resume with a different number of ranks is allowed (ranks without a file keep fresh RNG states).

Resuming restores the version numbering, the parameters and optimizer state, and the buffer
(with the trajectories logged after the checkpoint, wal.py), so staleness accounting continues
where it was (AReaL issue 1388: accounting that restarts from zero after a resume is the bug).
With no new arrivals the next step trains the groups the interrupted run trained; groups that a
launch admitted past the checkpoint's version are discarded (their policies are no longer in the
run's history), and groups arriving from the resumed workers may be taken first.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tandem.services.protocol import collectives, numbered_dirs, remove_leftovers

log = logging.getLogger(__name__)

SHARDED_DIR = "dist"


def rng_state() -> dict:
    """Every generator's state, in types `torch.load(weights_only=True)` reads back (NumPy's key
    array as a tensor): a checkpoint is loaded without unpickling arbitrary objects."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                    has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_steps(root: Path) -> list[int]:
    return numbered_dirs(root, "step-")


def latest(root: Path) -> Path | None:
    steps = checkpoint_steps(root)
    return Path(root) / f"step-{steps[-1]}" if steps else None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        collectives.barrier()


def save(root: Path, step: int, rank: int, rank_state: dict, loop_state: dict | None, keep: int,
         write_sharded: Callable[[Path], None] | None = None) -> Path:
    """Collective: every rank passes its `rank_state`; rank 0 also passes `loop_state`.
    `write_sharded(dir)`, when given, is called on every rank to write the backend's sharded
    checkpoint into `<checkpoint>/dist/` before the directory is renamed into place."""
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root, ".step-*.tmp")
        tmp.mkdir()
    _barrier()
    try:
        if write_sharded is not None:
            write_sharded(tmp / SHARDED_DIR)
        _save_file({**rank_state, "rng": rng_state()}, tmp / f"rank-{rank}.pt")
        if rank == 0:
            _save_file(loop_state or {}, tmp / "loop.pt")
    except BaseException:
        if rank == 0:   # half a checkpoint restores nothing, and its space may be what ran out
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in checkpoint_steps(root)[:-keep]:
            shutil.rmtree(root / f"step-{old}", ignore_errors=True)
        log.info("checkpoint saved: %s", final)
    _barrier()
    return final


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load_file(path: Path):
    """Tensors and plain data only (`weights_only=True`): a checkpoint directory another user can
    write to must not run code in the trainer. Checkpoints written before the NumPy RNG state was
    stored as a tensor hold a NumPy array, whose reconstruction alone is allowed."""
    core = getattr(np, "_core", None) or np.core    # NumPy 2 renamed it
    with torch.serialization.safe_globals([core.multiarray._reconstruct, np.ndarray, np.dtype,
                                           type(np.dtype(np.uint32))]):
        return torch.load(path, map_location="cpu", weights_only=True)


def load(path: Path, rank: int, sharded: bool = False) -> tuple[dict, dict]:
    """(this rank's state with RNG applied, loop state) from a checkpoint directory.

    `sharded`: the backend resumes from `sharded_dir(path)`; the checkpoint must hold one, and
    a missing rank file (a job with more ranks than the writer) only means fresh RNG states.
    """
    path = Path(path)
    rank_file = path / f"rank-{rank}.pt"
    if sharded:
        sharded_dir(path)
        if not rank_file.exists():
            log.info("%s: no RNG states for rank %d (written by a smaller job); keeping fresh ones",
                     path, rank)
            return {}, _load_file(path / "loop.pt")
    elif not rank_file.exists():
        raise FileNotFoundError(f"{rank_file}: missing; was this checkpoint written by a job with "
                                f"a different number of trainer ranks?")
    rank_state = _load_file(rank_file)
    loop_state = _load_file(path / "loop.pt")
    set_rng_state(rank_state.pop("rng"))
    return rank_state, loop_state


def sharded_dir(path: Path) -> Path:
    """The sharded backend checkpoint inside a checkpoint directory (ValueError when absent)."""
    d = Path(path) / SHARDED_DIR
    if not d.is_dir():
        raise ValueError(f"{path}: holds no sharded checkpoint ({SHARDED_DIR}/); it was written by "
                         f"a backend that checkpoints per rank (trainer.backend: torch)")
    return d
