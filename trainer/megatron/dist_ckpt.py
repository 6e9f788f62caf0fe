"""Resume checkpoints through `megatron.core.dist_checkpointing` (sharded, reshardable), one
format for every device and optimizer.

Every tensor is saved with its place in the full (global) tensor, so a checkpoint written with
one tensor-parallel layout loads into another. The optimizer state rides on the model's
sharding in model space (optim_state.py): per parameter its fp32 main weight and Adam moments
under `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>` (Megatron's
`make_sharded_optimizer_tensor`), Adam's step (`adam_step`, = the update count) and the update
count as common state. The CPU path's
torch AdamW and the GPU path's two Megatron optimizers are all read and written this way, so a
checkpoint resumes on either device, with either optimizer, in any TP/PP/DP layout; Megatron's
own optimizer checkpoint formats differ between its optimizers and are not used. The model's
sharded state is taken from the GPTModel itself, never from Megatron's DDP wrapper, whose
default `sharded_state_dict` would prefix every key with `module.` (as Megatron-LM's own
checkpointing unwraps the model first).

The training loop checkpoints the Megatron backend through this module (trainer/checkpoint.py
puts it in `step-<N>/dist/`); the per-rank `state_dict()` only reloads into the same layout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tandem.services.protocol import collectives
from tandem.trainer.megatron import optim_state


def _model_sharded(backend) -> dict:
    """The GPTModel's sharded state dict (unwrapped from DDP on GPUs: keys without `module.`)."""
    return backend._module().sharded_state_dict()


def optimizer_sharded(module, model_sd: dict, state: dict[str, dict[str, torch.Tensor]],
                      kinds=optim_state.KINDS) -> dict:
    """{name: {kind: the tensor on the model parameter's sharding}} for every parameter of the
    GPTModel `module` that its sharded state dict `model_sd` holds (matched by identity, as
    Megatron's own optimizers do). Loading asks for the `kinds` it wants (export: "param" only)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for t in nested_values(model_sd):
        name = names.get(id(getattr(t, "data", None)))
        if name is not None:
            out[name] = {kind: make_sharded_optimizer_tensor(t, state[name][kind], prefix=f"optimizer.state.{kind}")
                         for kind in kinds}
    return out


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
        state = optim_state.read(backend._module(), backend.optimizer)
        sd["optimizer"] = optimizer_sharded(backend._module(), model_sd, state)
        sd["adam_step"] = backend.updates   # every optimizer here takes one Adam step per update
    dist_checkpointing.save(sd, str(ckpt_dir))
    collectives.barrier()


def load(backend, ckpt_dir: str | Path) -> None:
    """Collective: restore model, optimizer and update count (any layout, device or optimizer
    of the writer)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = str(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    updates = int(common["updates"])
    model_sd = _model_sharded(backend)
    sd = {"model": model_sd}
    if updates > 0:
        template = {n: {k: torch.zeros_like(p, dtype=torch.float32) for k in optim_state.KINDS}
                    for n, p in backend._module().named_parameters()}
        sd["optimizer"] = optimizer_sharded(backend._module(), model_sd, template)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    backend.load_model_state(loaded["model"])
    if updates > 0:
        optim_state.init_state(backend.optimizer, step=int(common["adam_step"]))
        optim_state.write(backend._module(), backend.optimizer, loaded["optimizer"])
    backend.updates = updates
