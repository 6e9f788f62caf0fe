"""A tiny random Qwen3-MoE checkpoint, built with transformers, for the Megatron and torch backend
tests: megatron_case's sizes (vocab 61, hidden 64, 2 layers, 4 query heads over 2 KV groups) with
Qwen3's q/k norms and head_dim 24, untied embeddings (as Qwen3-30B-A3B), and in every layer 4
experts of intermediate size 32, each token routed to 2 (`norm_topk_prob` as asked: Qwen3-30B-A3B
renormalises the two weights).
"""
from __future__ import annotations

from pathlib import Path

from megatron_case import VOCAB, save_random

EXPERTS, TOPK = 4, 2


def moe_model(norm_topk_prob: bool = True, experts: int = EXPERTS):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                            num_experts=experts, num_experts_per_tok=TOPK, norm_topk_prob=norm_topk_prob,
                            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return tf.Qwen3MoeForCausalLM(cfg)


def make_moe_dir(out: Path, *, norm_topk_prob: bool = True, seed: int = 0) -> Path:
    """A HF directory (safetensors, one tensor per expert as transformers saves it) with
    non-trivial random weights: routers and experts ~0.15, norms around 1."""
    return save_random(moe_model(norm_topk_prob), out, seed)


def moe_trainer_cfg(ep: int = 1, tp: int = 1, aux: float = 0.0, z: float = 0.0, capacity: float = 0.0,
                    clip: float = 1.0, pp: int = 1):
    """megatron_case.trainer_cfg with expert parallelism and the MoE options (float32 parameters);
    `clip`: trainer.optim.grad_clip (the gradients read after a step are the clipped ones)."""
    from dataclasses import replace

    import megatron_case as mc

    cfg = mc.trainer_cfg(tp=tp, pp=pp, params_dtype="float32")
    return replace(cfg, expert_parallel=ep, optim=replace(cfg.optim, grad_clip=clip), megatron=replace(cfg.megatron, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z,
                                                             moe_capacity_factor=capacity))


def empty_batch():
    """A micro-batch of no tokens (what the allocator gives a rank with fewer sequences than
    micro-batches)."""
    import torch

    from tandem.trainer.backend import PackedBatch

    return PackedBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                       torch.zeros(1, dtype=torch.int32),
                       {"adv": torch.zeros(0), "loss_mask": torch.zeros(0, dtype=torch.bool)})


def ep2_micro_batches() -> list[list]:
    """Each of two data-parallel ranks' micro-batches: rank 0 two packs, rank 1 one pack and an
    empty one (its rank must still run a forward for the all-to-all)."""
    import megatron_case as mc

    a, b = mc.micro_batches(0), mc.micro_batches(1)
    return [[a[0], a[1]], [b[0], empty_batch()]]
