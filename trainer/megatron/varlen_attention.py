"""Padding-free core attention for Megatron's local layer spec, without TransformerEngine.

Megatron-core's local `DotProductAttention` refuses packed sequences (`packed_seq_params`), so
the local spec used to attend through a dense block-diagonal mask over the whole packed row:
memory and time in the square of the row's length, which ran a 0.5B model out of memory on a
139 GB H200 at 8K-token packs (issue 37). This subclass keeps the parent's constructor (its
softmax scale, per-partition head counts and dropout, from the installed release's own code) and
replaces the forward: the row arrives in THD layout (`qkv_format="thd"`: megatron-core squeezes
the batch dimension and applies rotary positions per sequence from `cu_seqlens`), and each
sequence is one causal `scaled_dot_product_attention` call, so memory grows with the longest
sequence squared, not the row's. SDPA picks its fused kernels on GPUs and its math kernel on the
CPU; grouped-query heads use SDPA's `enable_gqa`.

Values equal the dense-mask path's to float32 rounding (tests/unit/megatron: logits against
transformers, and TP = 2 against TP = 1). TransformerEngine stays the first choice where it is
installed (model.layer_spec).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from tandem.trainer.backend import packed_sequences


class VarlenCoreAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [t, heads, d], key/value [t, groups, d] (this rank's heads) -> [t, heads * d]."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("VarlenCoreAttention needs packed_seq_params in THD format (trainer/megatron/packing.py)")
        if attention_bias is not None:
            raise ValueError("VarlenCoreAttention takes no attention bias")
        cu = packed_seq_params.cu_seqlens_q
        p = self.config.attention_dropout if self.training else 0.0
        gqa = key.size(1) != query.size(1)
        outs = []
        # One split per tensor, not a slice per sequence (trainer/backend.py `packed_sequences`: a
        # slice's backward is a row-sized zero gradient per sequence).
        for q, k, v in packed_sequences(cu, 0, query, key, value):
            # [L, h, d] -> [1, h, L, d], SDPA's layout
            q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1))                      # [L, h, d]
        out = torch.cat(outs) if outs else query.new_zeros(query.shape)
        return out.reshape(out.size(0), -1)
