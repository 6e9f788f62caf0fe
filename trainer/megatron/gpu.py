"""The GPU-only calls into megatron-core: DDP, the (distributed) optimizer, THD forward, checkpoints.

Written against megatron-core 0.16.1's API and NOT run end to end on this CPU-only machine:
`get_megatron_optimizer` allocates CUDA tensors, and the THD forward needs TransformerEngine's
fused attention. The CPU path in backend.py uses torch AdamW with the same learning-rate
schedule and clipping semantics instead.

Every megatron-core call of this path lives here, with its receivers annotated with megatron
classes, so that tests/unit/megatron/test_megatron_api_contract.py can bind each call's arguments
against the installed release's real signatures (a renamed argument fails there, not on the
cluster). The config builders are separate functions so that the test also constructs the real
config dataclasses (their `__post_init__` validation runs on CPU).

Gradient scaling: the model's `TransformerConfig` has `calculate_per_token_loss=True`, so DDP
SUMS gradients over data-parallel ranks (no 1/dp factor) — the contract of trainer/backend.py,
where the loss is already divided by the global number of valid tokens.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from services.protocol import collectives
from trainer.megatron.packing import thd_packed_seq_params

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

# The distributed optimizer's dist-checkpoint format. 'fully_reshardable' stores each
# parameter's optimizer state in its canonical (model-space) shape, so a checkpoint loads into
# another tensor/pipeline/data-parallel layout; megatron-core 0.16.1's default,
# 'fully_sharded_model_space', is marked deprecated there, and 'dp_reshardable' reshards over
# DP only. Non-distributed optimizers ignore the key.
SHARDED_STATE_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def ddp_config(mcfg) -> DistributedDataParallelConfig:
    """DDP settings: fp32 gradient buffers, one reduction after the last micro-batch."""
    from megatron.core.distributed import DistributedDataParallelConfig

    # No overlap_grad_reduce: the micro-batch loop does not run Megatron's `no_sync` context,
    # so gradients must be reduced once, after the last micro-batch (finalize_model_grads).
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=mcfg.use_distributed_optimizer)


def optimizer_config(optim, mcfg, dtype: torch.dtype) -> OptimizerConfig:
    """Adam(W) settings from `trainer.optim` (the torch backend's optimizer, in Megatron terms)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
        adam_beta2=optim.beta2, adam_eps=optim.eps,
        # Megatron clips when clip_grad > 0, like trainer.optim.grad_clip (0 = off).
        clip_grad=optim.grad_clip,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=mcfg.use_distributed_optimizer)


def wrap_model_and_optimizer(model: GPTModel, config, mcfg, optim, dtype: torch.dtype
                             ) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """(DDP-wrapped model, MegatronOptimizer) with AdamW settings from `trainer.optim`."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(mcfg), module=model)
    return ddp, get_megatron_optimizer(optimizer_config(optim, mcfg, dtype), [ddp])


def forward_thd(model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Packed forward in TransformerEngine's THD format (no mask). `model` is the DDP wrapper at
    run time, which hands its arguments to the wrapped GPTModel unchanged: GPTModel.forward's
    signature is the contract."""
    return model(input_ids, position_ids, None,
                 packed_seq_params=thd_packed_seq_params(cu_seqlens, device))


def zero_grad(model: DistributedDataParallel, optimizer: MegatronOptimizer) -> None:
    """Start a step: clear DDP's contiguous gradient buffers and the optimizer's gradients."""
    model.zero_grad_buffer()
    optimizer.zero_grad()


def step(model: DistributedDataParallel, optimizer: MegatronOptimizer, lr: float) -> tuple[bool, float]:
    """Finish gradient sync and apply one update at `lr`: (applied, global grad norm)."""
    from megatron.core.distributed import finalize_model_grads

    # DP reduce of the grad buffers plus the tied-embedding all-reduce between pipeline stages;
    # no num_tokens argument: the loss is already normalised by the global token count.
    finalize_model_grads([model])
    for group in optimizer.param_groups:
        group["lr"] = lr
    # megatron-core 0.16.1: (update_successful, grad_norm, num_zeros_in_grad); grad_norm is
    # computed only when clip_grad > 0, and is None when the update was skipped.
    applied, grad_norm, _ = optimizer.step()
    return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")


def optimizer_sharded_state(optimizer: MegatronOptimizer, model_sharded: dict, is_loading: bool) -> dict:
    """The optimizer's sharded state dict, laid out on the model's sharding (reshardable)."""
    if is_loading:
        _init_torch_adam_state(optimizer)
    return optimizer.sharded_state_dict(model_sharded, is_loading=is_loading,
                                        metadata=SHARDED_STATE_METADATA)


def _init_torch_adam_state(optimizer) -> None:
    """Give a fresh optimizer's torch Adam(W) the state a step would (step 0, zero moments).

    Why: without TransformerEngine or Apex, megatron-core 0.16.1 falls back to torch's AdamW,
    whose state appears at the first step; `DistributedOptimizer.sharded_state_dict(is_loading=
    True)` (the template a resume loads into) reads the common step from that state before
    anything initialises it (`assert len(steps) == 1` on an empty state). The loaded checkpoint
    then overwrites all of it. TE's and Apex's fused Adams keep their state otherwise: untouched.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def load_optimizer_state(optimizer: MegatronOptimizer, state: dict) -> None:
    """Install the optimizer state returned by `dist_checkpointing.load`."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) == 1 and _torch_adam_with_fully_reshardable_state(opts[0], state):
        _load_fully_reshardable(opts[0], state)
    else:
        optimizer.load_state_dict(state)


def _torch_adam_with_fully_reshardable_state(opt, state: dict) -> bool:
    return (state.get("param_state_sharding_type") == "fully_reshardable"
            and isinstance(getattr(opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW)))


def _load_fully_reshardable(opt: DistributedOptimizer, state: dict) -> None:
    """`DistributedOptimizer.load_state_dict` in its own two steps, with torch Adam's `step` aside.

    Why: megatron-core 0.16.1 without TransformerEngine or Apex uses torch's AdamW, which keeps a
    `step` per parameter. `load_state_dict` first sets that step from the checkpoint, then
    `load_parameter_state_from_fully_reshardable` copies every per-parameter state tensor it was
    given into every state key the optimizer has, and it was given none for `step` (it skips it
    on purpose): `KeyError: 'step'`. So the step is held aside while the parameter state loads.
    """
    param_state = state.pop("param_state")
    state.pop("param_state_sharding_type")
    opt.load_state_dict(state)      # param groups, grad scaler, the common step
    inner = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step


# ---- fp32 main weights ----------------------------------------------------------------------------
# With bf16/fp16 parameters Megatron's optimizer updates fp32 main copies and rounds them into the
# parameters after each step. The backend loads the checkpoint's fp32 values into the main copies
# (not the rounded parameters) and exports the main copies: a bf16 run then starts from exactly the
# weights it was given, and publishes the weights it trains, as the torch backend does in fp32.


def _main_copies(model: GPTModel, optimizer) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor | None,
                                                               slice | None, object]]:
    """(name, parameter, this rank's fp32 main tensor, its place in the flattened parameter or None
    for all of it, the data-parallel group its shards are spread over or None) for every parameter
    the optimizer keeps a main copy of, in the model's order (the same on every rank).

    megatron-core 0.16.1 records the copy on the parameter: `Float16OptimizerWithFloat16Params` sets
    `param.main_param` (the whole tensor); `DistributedOptimizer` sets it to this DP rank's shard,
    or None when the rank holds none of it, with `param.main_param_sharded = True`, and keeps the
    shard's range in `_get_model_param_range_map`. fp32 parameters have no copy: they are their
    own main weights. `get_megatron_optimizer` returns a `ChainedOptimizer` (one per buffer group).
    """
    places, dp_group = {}, None
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "model_param_gbuf_map"):   # a DistributedOptimizer
            dp_group = opt.data_parallel_group
            for p in opt.model_param_gbuf_map:
                r = opt._get_model_param_range_map(p)["param"]
                places[p] = slice(r.start, r.end)
    for name, p in model.named_parameters():
        if getattr(p, "main_param", None) is None and not getattr(p, "main_param_sharded", False):
            continue
        if getattr(p, "main_param_sharded", False):
            yield name, p, p.main_param, places.get(p), dp_group
        else:
            yield name, p, p.main_param, None, None


def load_main_params(model: GPTModel, optimizer, state: dict[str, torch.Tensor]) -> int:
    """Copy full-precision values (this rank's TP shards, GPTModel names) into the main copies;
    returns how many parameters have one."""
    n = 0
    for name, _, main, place, _ in _main_copies(model, optimizer):
        n += 1
        if main is None:
            continue
        src = state[name].to(main.device, torch.float32)
        main.copy_(src if place is None else src.reshape(-1)[place])
    return n


def main_params(model: GPTModel, optimizer) -> dict[str, torch.Tensor]:
    """{name: the whole fp32 main copy of this rank's TP shard} for every parameter that has one.

    Collective over the data-parallel group with the distributed optimizer (each DP rank holds a
    disjoint part of each parameter: zeros elsewhere, summed), so every rank must call it.
    """
    out = {}
    for name, p, main, place, group in _main_copies(model, optimizer):
        if place is None and group is None:
            out[name] = main.detach().clone().view_as(p)
            continue
        flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if main is not None and place is not None:
            flat[place] = main.detach().reshape(-1)
        out[name] = collectives.all_reduce(flat, group=group).view_as(p)
    return out
