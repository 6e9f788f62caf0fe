"""The GPU-only half of the optimizer path: Megatron's DDP and (distributed) optimizer.

Written against megatron-core 0.16.1's API and NOT run on this CPU-only machine: both
`DistributedDataParallel` (contiguous CUDA gradient buffers) and `get_megatron_optimizer`
(fp32 main params, CUDA multi-tensor kernels) require CUDA. The CPU path in backend.py uses
torch AdamW with the same learning-rate schedule and clipping semantics instead.

Gradient scaling: the model's `TransformerConfig` has `calculate_per_token_loss=True`, so DDP
SUMS gradients over data-parallel ranks (no 1/dp factor) — the contract of trainer/backend.py,
where the loss is already divided by the global number of valid tokens.
"""
from __future__ import annotations

import torch


def wrap_model_and_optimizer(model, config, mcfg, optim, dtype: torch.dtype):
    """(DDP-wrapped model, MegatronOptimizer) with AdamW settings from `trainer.optim`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # No overlap_grad_reduce: the micro-batch loop does not run Megatron's `no_sync` context,
    # so gradients must be reduced once, after the last micro-batch (finalize_model_grads).
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=mcfg.use_distributed_optimizer)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
        adam_beta2=optim.beta2, adam_eps=optim.eps,
        # Megatron clips when clip_grad > 0, like trainer.optim.grad_clip (0 = off).
        clip_grad=optim.grad_clip,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=mcfg.use_distributed_optimizer)
    return ddp, get_megatron_optimizer(opt_cfg, [ddp])


def step(model, optimizer, lr: float) -> tuple[bool, float]:
    """Finish gradient sync and apply one update at `lr`: (applied, global grad norm)."""
    from megatron.core.distributed import finalize_model_grads

    # DP reduce of the grad buffers plus the tied-embedding all-reduce between pipeline stages;
    # no num_tokens argument: the loss is already normalised by the global token count.
    finalize_model_grads([model])
    for group in optimizer.param_groups:
        group["lr"] = lr
    applied, grad_norm, _ = optimizer.step()
    return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")
