"""Megatron's GPU-path optimizers on CPU tensors, for tests (issue 31).

`get_megatron_optimizer`'s optimizers (Float16OptimizerWithFloat16Params, DistributedOptimizer)
run unchanged on CPU except for two things a CPU cannot provide, which `cuda_on_cpu()` stands in
for while they run (the only stand-in; the tests that use it say so): CUDA type names
(`param.type()` reports 'torch.cuda.BFloat16Tensor' for a CPU bf16 tensor: their constructors
accept nothing else) and CUDA placement (`device='cuda'` and `.cuda()` stay on the CPU).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


class _CudaPlacementOnCpu(TorchFunctionMode):
    """`device='cuda'` arguments and `.cuda()` calls stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextmanager
def cuda_on_cpu():
    """Megatron's optimizers on CPU tensors: CUDA type names and placement, for the duration."""
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    try:
        with _CudaPlacementOnCpu():
            yield
    finally:
        torch.Tensor.type = real_type


def bf16_model(backend, seed: int = 0):
    """(GPTModel, TransformerConfig) of the GPU path (bf16 params, the local spec as on a GPU
    without TransformerEngine) built on CPU with the backend's own code, for the layout of the
    in-process `backend` (whose construction set up the process group and cpu_compat)."""
    from tandem.trainer.megatron import cpu_compat
    from tandem.trainer.megatron.model import build_gpt_model, layer_spec, transformer_config
    from tandem.trainer.megatron.shape import decoder_shape

    shape = decoder_shape(backend.model_dir)
    config = transformer_config(shape, torch.bfloat16, on_gpu=False)
    with cpu_compat.model_construction():
        model = build_gpt_model(shape, config, layer_spec(on_gpu=False, qk_norm=shape.qk_norm), backend.padded_vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # weights are loaded, never initialised, by the backend: fill them
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model, config


def gpu_optimizer(backend, model, config, distributed: bool):
    """(DDP-wrapped model, MegatronOptimizer) from the backend's own `gpu.wrap_model_and_optimizer`."""
    from tandem.trainer.config import OptimConfig
    from tandem.trainer.megatron import gpu
    from tandem.trainer.megatron.config import MegatronConfig

    mcfg = MegatronConfig(use_distributed_optimizer=distributed)
    with cuda_on_cpu():
        return gpu.wrap_model_and_optimizer(model, config, mcfg, OptimConfig(grad_clip=1.0), torch.bfloat16)
