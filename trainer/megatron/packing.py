"""Packed (padding-free) micro-batches for GPTModel: one row holding several whole sequences.

Each token sees the earlier tokens of its own sequence only, with rotary positions restarting
at 0 for every sequence: THD format, `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv,
max_seqlen_q/kv)`, which TE's fused attention (the TE spec) and `VarlenCoreAttention` (the local
spec, varlen_attention.py) treat as `len(cu_seqlens) - 1` sequences, no mask, no N^2 memory.

The block-diagonal causal mask `[1, 1, N, N]` (True = masked) is the same pattern written out:
what the local spec's `DotProductAttention` took before VarlenCoreAttention, and the reference
it is tested against (N^2 memory).
"""
from __future__ import annotations

import torch

from tandem.trainer.backend import to_device


def block_diagonal_causal_mask(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """Boolean `[1, 1, N, N]`, True where attention is NOT allowed (Megatron's convention)."""
    cu = cu_seqlens.long()
    n = int(cu[-1])
    lengths = (cu[1:] - cu[:-1]).to(device)
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    allowed = causal & (segment[:, None] == segment[None, :])
    return (~allowed)[None, None]


def thd_packed_seq_params(cu_seqlens: torch.Tensor, device):
    """`PackedSeqParams` of a packed row (THD format: TE's attention or VarlenCoreAttention)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    # the longest sequence from the packer's host copy: read from a device copy, it would wait
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    cu = to_device(cu_seqlens.to(torch.int32), torch.device(device))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)
