"""Resume checkpoints through `megatron.core.dist_checkpointing` (sharded, reshardable).

Every tensor is saved with its place in the full (global) tensor, so a checkpoint written with
one tensor-parallel layout loads into another. The optimizer state rides on the model's
sharding: on CPU the torch AdamW moments are mapped onto the parameters' sharded tensors with
Megatron's own `optim_state_to_sharding_state`; on GPU Megatron's optimizer provides its
`sharded_state_dict` (in the 'fully_reshardable' format, see gpu.py). The model's sharded
state is taken from the GPTModel itself, never from Megatron's DDP wrapper, whose default
`sharded_state_dict` would prefix every key with `module.` (so GPU and CPU checkpoints share
their keys, as Megatron-LM's own checkpointing unwraps the model first). AdamW's scalar `step` (equal for every parameter) and the update count
travel as common (unsharded) state.

The training loop checkpoints the Megatron backend through this module (trainer/checkpoint.py
puts it in `step-<N>/dist/`); the per-rank `state_dict()` only reloads into the same layout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from services.protocol import collectives
from trainer.megatron import gpu

_EXCLUDED = ("step",)


def _model_sharded(backend) -> dict:
    """The GPTModel's sharded state dict (unwrapped from DDP on GPUs: keys without `module.`)."""
    return backend._module().sharded_state_dict()


def _cpu_optimizer_sharded(optimizer, params, model_sd, template: bool) -> dict:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    if template:
        state["state"] = {i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                          for i, p in enumerate(params)}
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=_EXCLUDED)
    return state


def save(backend, ckpt_dir: str | Path) -> None:
    """Collective: every rank writes its shards of model and optimizer into `ckpt_dir`."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    if backend.rank == 0:
        if ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)
        ckpt_dir.mkdir(parents=True)
    collectives.barrier()
    model_sd = _model_sharded(backend)
    sd = {"model": model_sd, "updates": backend.updates}
    if backend.updates > 0:
        if backend.on_gpu:
            sd["optimizer"] = gpu.optimizer_sharded_state(backend.optimizer, model_sd, is_loading=False)
        else:
            sd["optimizer"] = _cpu_optimizer_sharded(backend.optimizer, backend.params, model_sd, False)
            sd["adam_step"] = backend.updates
    dist_checkpointing.save(sd, str(ckpt_dir))
    collectives.barrier()


def load(backend, ckpt_dir: str | Path) -> None:
    """Collective: restore model, optimizer and update count (any TP layout of the writer)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = str(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    updates = int(common["updates"])
    model_sd = _model_sharded(backend)
    sd = {"model": model_sd}
    if updates > 0:
        if backend.on_gpu:
            sd["optimizer"] = gpu.optimizer_sharded_state(backend.optimizer, model_sd, is_loading=True)
        else:
            sd["optimizer"] = _cpu_optimizer_sharded(backend.optimizer, backend.params, model_sd, True)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    backend.load_model_state(loaded["model"])
    if updates > 0:
        opt = loaded["optimizer"]
        if backend.on_gpu:
            gpu.load_optimizer_state(backend.optimizer, opt)
        else:
            step = torch.tensor(float(common["adam_step"]))
            for entry in opt["state"].values():
                entry["step"] = step.clone()
            backend.optimizer.load_state_dict(opt)
    backend.updates = updates
