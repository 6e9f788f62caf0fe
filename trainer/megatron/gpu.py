"""The GPU-only calls into megatron-core: DDP, the (distributed) optimizer; and the THD forward.

The optimizer's state is read and written per parameter by optim_state.py (checkpoints, export).

Written against megatron-core 0.16.1's API and NOT run end to end on this CPU-only machine:
`get_megatron_optimizer` allocates CUDA tensors. The THD forward runs on both paths (with the
local spec's VarlenCoreAttention on the CPU). The CPU path in backend.py uses torch AdamW with
the same learning-rate schedule and clipping semantics instead.

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

import contextlib
from typing import TYPE_CHECKING

import torch

from tandem.trainer.megatron.packing import thd_packed_seq_params

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig

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
                cu_seqlens: torch.Tensor, bounds_device) -> torch.Tensor:
    """Packed forward in THD format (no mask; TE's attention or VarlenCoreAttention), the bounds
    on `bounds_device` (model.bounds_device). `model` is the DDP wrapper at run time, which hands
    its arguments to the wrapped GPTModel unchanged: GPTModel.forward's signature is the contract."""
    return model(input_ids, position_ids, None,
                 packed_seq_params=thd_packed_seq_params(cu_seqlens, bounds_device))


def forward_thd_hidden(model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       cu_seqlens: torch.Tensor, bounds_device) -> torch.Tensor:
    """forward_thd, but the last stage returns its final hidden states [N, 1, hidden] (after the
    final norm) instead of logits, for the chunked log-prob step (logprob_head.py).

    How: megatron-core 0.16.1's GPTModel.forward has no argument for it (`labels` gives a loss,
    `runtime_gather_output` only gathers); its `_postprocess` returns the decoder's output
    unchanged on a stage built without `post_process` (what every earlier pipeline stage
    returns), and the final norm belongs to the decoder block (built with the model's
    `post_process`, read at construction only), with either layer spec. So the flag is
    cleared for this one call and restored, and the output layer is not run."""
    with _without_output_layer(getattr(model, "module", model)):   # the GPTModel under DDP
        return forward_thd(model, input_ids, position_ids, cu_seqlens, bounds_device)


@contextlib.contextmanager
def _without_output_layer(gpt: GPTModel):
    """GPTModel.forward returns the decoder's output (after the final norm) inside this scope."""
    post_process = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = post_process


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
