"""Settings only the Megatron-core backend reads (section `trainer.megatron` once wired in).

The parallel sizes themselves (`trainer.tensor_parallel`, `trainer.pipeline_parallel`) live in
`TrainerConfig` because the launcher needs them to size the trainer job.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MegatronConfig:
    """Precision, vocabulary padding and optimizer flavour of the Megatron-core backend."""
    # Parameter dtype on GPUs (the CPU path always uses float32: bf16 matmuls on CPU are slow
    # and the tests compare against float32 transformers logits).
    params_dtype: str = "bfloat16"
    # The embedding/output rows are padded to a multiple of this times tensor_parallel, so every
    # TP rank holds an equal vocabulary slice (Megatron-LM's make-vocab-size-divisible-by). The
    # padded rows are zeros, never produce log-probs, and are stripped on export.
    vocab_multiple: int = 128
    # GPU only: Megatron's distributed optimizer (optimizer state sharded over data-parallel
    # ranks). The CPU path always uses torch AdamW over the local shards.
    use_distributed_optimizer: bool = True
    # Activation recompute (Megatron's full granularity, one layer per unit): a layer keeps only
    # its input and recomputes the rest in the backward pass, about a third more compute for a
    # fraction of the activation memory (`tandem plan` prints both ways; docs/plan.md).
    recompute: bool = False

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.params_dtype not in DTYPES:
            out.append(("params_dtype", f"must be one of {', '.join(DTYPES)}, got {self.params_dtype!r}"))
        if self.vocab_multiple < 1:
            out.append(("vocab_multiple", f"must be >= 1, got {self.vocab_multiple}"))
        return out
