"""Settings only the Megatron-core backend reads (section `trainer.megatron` once wired in).

The parallel sizes themselves (`trainer.tensor_parallel`, `trainer.pipeline_parallel`) live in
`TrainerConfig` because the launcher needs them to size the trainer job.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
DISPATCHERS = ("alltoall", "allgather")
# trainer.recompute and trainer.megatron.recompute: on, off, or chosen by memory at the start.
RECOMPUTE = (True, False, "auto")


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
    # fraction of the activation memory (`tandem plan` prints both ways; docs/plan.md). auto: on
    # when the rank's predicted peak without it exceeds the GPU's free memory less 10%, decided
    # at the trainer's start, the same on every rank, and logged (as trainer.recompute: auto).
    recompute: bool | str = "auto"
    # Mixture-of-experts models (Qwen3-MoE) only; docs/megatron.md, "Mixture of experts".
    # Switch-Transformer load-balancing loss of each MoE layer, times this coefficient, added to
    # the training loss (megatron-core's `aux_loss`; 0 = off; Megatron-LM uses 1e-2, Qwen3-MoE's
    # config.json says 1e-3).
    moe_aux_loss_coeff: float = 0.0
    # ST-MoE router z-loss (the squared log-sum-exp of the router logits), times this (0 = off;
    # 1e-3 is the usual start).
    moe_z_loss_coeff: float = 0.0
    # Expert capacity as a multiple of the even share (tokens x top-k / experts) of each micro-batch;
    # assignments past it are dropped (lowest router probability first) and counted in the
    # `moe_dropped_fraction` metric. 0 = dropless: every token reaches its k experts, as in the
    # generation engine (what RL wants: a dropped token is computed differently there).
    moe_capacity_factor: float = 0.0
    # How tokens reach the experts of other expert-parallel ranks: megatron-core's `alltoall`
    # (tokens of different counts per rank, what packed RL micro-batches have) or `allgather`
    # (every rank's tokens gathered; megatron-core 0.16.1 needs equal token counts on every rank
    # for it, so it is refused with trainer.expert_parallel > 1).
    moe_token_dispatcher: str = "alltoall"

    def problems(self) -> list[tuple[str, str]]:
        out = []
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor"):
            if getattr(self, key) < 0:
                out.append((key, f"must be >= 0 (0 = off), got {getattr(self, key)}"))
        if self.moe_token_dispatcher not in DISPATCHERS:
            out.append(("moe_token_dispatcher", f"must be one of {', '.join(DISPATCHERS)}, "
                                                f"got {self.moe_token_dispatcher!r}"))
        if self.params_dtype not in DTYPES:
            out.append(("params_dtype", f"must be one of {', '.join(DTYPES)}, got {self.params_dtype!r}"))
        if self.recompute not in RECOMPUTE:
            out.append(("recompute", f"must be true, false or auto, got {self.recompute!r}"))
        if self.vocab_multiple < 1:
            out.append(("vocab_multiple", f"must be >= 1, got {self.vocab_multiple}"))
        return out
