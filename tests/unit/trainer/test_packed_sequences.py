"""A packed row's sequences are taken apart by one split, in both backends' attention
(trainer/backend.py `packed_sequences`): the backward pass then writes each sequence's gradient
into one row-sized tensor. A slice per sequence made a row-sized zero gradient per sequence and
added them all — on an H200, 50 ms of fills and 112 ms of adds in a 1,244 ms step at 32K tokens
(benchmarks/results/gpu_speed.json). The Megatron backend's core attention is checked the same
way in tests/unit/megatron/test_megatron_backend.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from op_count import OpCount

from tandem.trainer.backend import packed_sequences


def test_the_parts_are_the_sequences_and_a_row_they_do_not_cover_is_refused():
    x = torch.arange(20.0).reshape(2, 10)
    parts = [p for (p,) in packed_sequences(torch.tensor([0, 3, 4, 10], dtype=torch.int32), 1, x)]
    assert [p.tolist() for p in parts] == [x[:, 0:3].tolist(), x[:, 3:4].tolist(), x[:, 4:10].tolist()]
    with pytest.raises(ValueError, match="does not cover the packed row of 10 tokens"):
        packed_sequences(torch.tensor([0, 3, 8]), 1, x)


def test_the_torch_backends_packed_attention_slices_nothing_and_equals_per_sequence_sdpa():
    from tandem.trainer.torch_backend import varlen_sdpa_attention

    cu = torch.tensor([0, 5, 6, 13, 24, 32], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 4, 32, 8, generator=gen) for _ in range(3)]
    module = SimpleNamespace(num_key_value_groups=1, is_causal=True, training=False)

    q, k, v = (t.clone().requires_grad_(True) for t in base)
    with OpCount() as count:
        out, _ = varlen_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu)
        out.square().sum().backward()
    assert count.ops.get("slice_backward", 0) == 0, count.ops

    bounds = cu.tolist()
    rq, rk, rv = (t.clone().requires_grad_(True) for t in base)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        rq[:, :, a:b], rk[:, :, a:b], rv[:, :, a:b], is_causal=True).transpose(1, 2)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got, ref in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=0)
