"""trainer.compile: the decoder's elementwise work and the log-prob chunks under torch.compile.

Why: an H200's profiles of the torch backend (benchmarks/results/gpu_speed.json) spend most of a
step's device time outside the matrix products, in thousands of small elementwise kernels of the
eager model (RMSNorm's float32 round trip, rotary embeddings, SiLU x gate, residual adds), and
the GPU waits on the host that launches them. Inductor generates kernels that fuse runs of them.

Regional compilation, as PyTorch's recipe for repeated blocks has it: each decoder layer is
compiled, not the whole model, so the layers share one compiled graph (compile time is one
layer's, not the model's), and the embedding, the final norm and the output layer stay eager.
The packed attention function runs eagerly inside a compiled layer (`torch.compiler.disable`,
trainer/torch_backend.py): it splits the pack at its sequence boundaries, sizes that only the
data knows, which would otherwise end the graph at an unplanned place and recompile per pack.
Shapes are compiled dynamic, so a new pack length or sequence count reuses the graph (RL batches
change both every step); the log-prob chunk function (trainer/logprobs.py `_rows`) is compiled
the same way, fusing the float32 cast, the log-softmax, the gather and the entropy.

The Megatron backend's layers do not compile whole: megatron-core 0.16.1 breaks the graph in
three places of its own (docs/megatron.md, "Packed sequences"). There trainer.compile turns on
megatron-core's own fused SwiGLU (`bias_activation_fusion`, whose kernels its `jit_fuser` puts
under torch.compile) and, with one tensor-parallel rank, compiles the log-prob chunks as here.

Values agree with the eager model within float32 rounding, not bit for bit (fused kernels
reorder sums): tests/integration/trainer/test_compiled_backend.py. The first step of a process
pays the compilation (seconds to a minute); a run pays it once per trainer process.
"""
from __future__ import annotations

import torch

# Inductor is PyTorch's own code generator (Triton kernels on a GPU, C++ on a CPU). A test may
# set another torch.compile backend here ("aot_eager" traces without generating code).
BACKEND = "inductor"
# Graphs one compiled function may keep (torch._dynamo's recompile_limit, 8 by default), past
# which it runs eagerly from then on, with only a log line to say so. Each combination of what a
# step asks of a layer is a graph of its own: with and without gradients, with and without the
# entropy, LoRA's reference pass with the adapters off, and a pack past a size Dynamo first
# bounded; a LoRA run with a KL penalty made 6 of one function here (the tiny model, the CPU).
RECOMPILE_LIMIT = 32


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated decoder layers: transformers' GradientCheckpointingLayer subclasses,
    the base class of every decoder layer of its causal LMs (LoRA wrappers included)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model) -> int:
    """Compile each decoder layer in place (`nn.Module.compile`: the module stays the same object,
    so its parameters, the optimizer, checkpoints, LoRA and recompute see no difference); returns
    how many. A model without recognisable decoder layers is refused by name."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.compile: {type(model).__name__} has no transformers decoder layers "
                         f"(GradientCheckpointingLayer) to compile; set trainer.compile: false")
    _raise_recompile_limit()
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=True)
    return len(layers)


def compiled_chunk_fn():
    """trainer/logprobs.py's per-chunk function, compiled (dynamic shapes)."""
    from tandem.trainer.logprobs import _rows

    _raise_recompile_limit()
    return torch.compile(_rows, backend=BACKEND, dynamic=True)


def _raise_recompile_limit() -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
