"""The running batch's KV cache gives every row the logits it would get decoded alone.

No processes: a random two-layer Qwen2 on CPU. Rows of different lengths join in rounds (one
shorter and one longer than the batch, so the valid columns grow to the left), decode past the
buffers' spare columns and row capacity, move apart once long (a second rectangle), and leave
from both rectangles at once (the last rows move into the holes; the padding prefix is dropped).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from tandem.rollout.server import cohorts, kv_rows
from tandem.rollout.server.cohorts import rows_to_set_apart
from tandem.rollout.server.kv_batch import KVBatch
from tandem.rollout.server.kv_rows import RowBuffer, RowKV


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).eval()


def _prefill(model, seq):
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([seq]), **kv_rows.with_cache(model, cache), use_cache=True)
    return cache, len(seq)


def _alone(model, seq):
    return model(input_ids=torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("apart", [False, True], ids=["one-rectangle", "long-rows-apart"])
@torch.no_grad()
def test_batched_decode_matches_each_row_alone(monkeypatch, apart):
    monkeypatch.setattr(kv_rows, "SPARE_COLUMNS", 3)   # force reallocations within a few steps
    if apart:   # small thresholds, so a few rows are enough to set the longest apart
        monkeypatch.setattr(cohorts, "APART_MIN_TOKENS", 1)
        monkeypatch.setattr(cohorts, "APART_MIN_ROWS", 1)
    else:
        monkeypatch.setattr(cohorts, "APART_MIN_ROWS", 10**6)
    model = _model()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 50, (n,), generator=gen).tolist() for n in (5, 17, 9, 12)]
    kv = KVBatch()
    rows: list[list[int]] = []
    passes = set()

    def join(new):
        nonlocal rows
        combined = rows + new
        rows = [combined[i] for i in kv.add_many([_prefill(model, s[:-1]) for s in new])]

    join(seqs[:2])
    for step in range(15):
        if step == 3:   # joins: one shorter, one much longer than the batch
            join([seqs[2], seqs[2] + [7] * 30])
        if step == 7:   # the two shortest leave; the last rows move into their holes
            shortest = sorted(range(len(rows)), key=lambda i: len(rows[i]))[:2]
            rows = [rows[i] for i in kv.remove(shortest)]
        if step == 9:   # a round of short rows, past the row capacity: the long rows move apart
            join([seqs[3][:4], seqs[0][:2], seqs[1][:3]])
        if step == 11:  # rows of both rectangles leave at once
            rows = [rows[i] for i in kv.remove([0, len(rows) - 1])]
        if step == 12:  # more short rows: rows move apart beside the long ones already there
            join([seqs[0][:2], seqs[1][:2], seqs[2][:2]])
        passes.add(kv.passes)
        logits = kv.decode(model, torch.tensor([[r[-1]] for r in rows]))
        for i, r in enumerate(rows):
            torch.testing.assert_close(logits[i], _alone(model, r), atol=1e-4, rtol=1e-4)
        assert kv.lengths == [len(r) for r in rows]
        rows = [r + [int(logits[i].argmax())] for i, r in enumerate(rows)]
    assert (2 in passes) is apart
    assert kv.remove(list(range(kv.size))) == []
    assert kv.size == 0 and kv.padded_entries == 0


@torch.no_grad()
def test_a_leaving_row_copies_only_itself():
    """Leaving copies one row into the hole: the other rows' storage is untouched."""
    model = _model()
    buf = RowBuffer()
    buf.add_rows([RowKV.of_cache(*_prefill(model, list(range(1, n)))) for n in (6, 9, 4, 7)])
    storage = buf.keys[0].data_ptr()
    before = buf.keys[0][0, :, buf.lo:buf.hi].clone()
    assert buf.remove([1]) == [0, 3, 2]
    assert buf.keys[0].data_ptr() == storage
    torch.testing.assert_close(buf.keys[0][0, :, buf.lo:buf.hi], before[:, -buf.width:])


def test_rows_grown_long_are_set_apart_only_when_enough_rows_stop_paying():
    short = [40] * 9
    assert rows_to_set_apart([450, *short]) == [0]
    assert rows_to_set_apart([450, *short[:6]]) == []                 # too few rows behind it
    assert rows_to_set_apart([450, *short[:6]], [12, 12]) == [0]      # joining rows count
    assert rows_to_set_apart([70, *short]) == []                      # under twice the median
    assert rows_to_set_apart([60] * 12) == []                         # a synchronous wave


@torch.no_grad()
def test_the_cache_goes_under_the_name_the_models_forward_takes():
    """transformers 5 renamed forward's `past_key_values` to `cache`; the old name warns and is
    removed in 5.40, inside setup.cfg's range. The installed release's model decodes without that
    warning, and a model whose forward has only the old name (the releases before, and
    tests/unit/generation/test_engine_device.py's stand-in) still gets it."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        kv = KVBatch()
        kv.add_many([_prefill(model, [3, 5, 7])])
        kv.decode(model, torch.tensor([[9]]))

    class OldForward(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=True):
            return past_key_values
    assert kv_rows.with_cache(OldForward(), "kv") == {"past_key_values": "kv"}
