"""Dynamic micro-batching: balanced allocation under a token budget, then padding-free packing.

RL outputs have long-tailed lengths (a few 32K-token answers among many 1K ones). A fixed number
of sequences per micro-batch either overflows memory on the long ones or, padded, wastes most
of its compute (shared/BASELINES.md: 44% padding). AReaL's Algorithm 1 instead sorts sequences
longest first and puts each into the least-loaded micro-batch that still has room, opening a
new one only when none has. The least-loaded micro-batch has the most room, so "does any fit?"
is one heap lookup: O(n log m) instead of the pure-Python O(n m) scan.

Data parallelism needs every rank to run the same number of micro-batches (collectives pair
them up), so the count is raised to a multiple of the DP size and the micro-batches are dealt
to ranks largest first, each to the least-loaded rank that still has a free slot.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from tandem.trainer.backend import PackedBatch


def allocate(lengths: Sequence[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of at most `max_tokens` tokens each.

    At least `min_count` micro-batches (some may be empty when there are fewer sequences).
    Deterministic: ties are broken by index, so the same input always gives the same output.
    Within a micro-batch, indices keep their original order.
    """
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size and (arr.max() > max_tokens or arr.min() < 0):
        i = int(np.flatnonzero((arr > max_tokens) | (arr < 0))[0])
        if arr[i] < 0:
            raise ValueError(f"sequence {i} has a negative length {int(arr[i])}")
        raise ValueError(f"sequence {i} has {int(arr[i])} tokens, more than max_tokens_per_mb={max_tokens}")
    # Longest first; equal lengths in index order (a stable sort of the negated lengths).
    order = np.argsort(-arr, kind="stable").tolist()
    lens = arr.tolist()
    bins: list[list[int]] = [[] for _ in range(max(1, min_count))]
    heap = [(0, b) for b in range(len(bins))]  # (load, bin id): least loaded on top
    replace, push = heapq.heapreplace, heapq.heappush
    for i in order:
        n = lens[i]
        load, b = heap[0]
        if load + n <= max_tokens:
            bins[b].append(i)
            replace(heap, (load + n, b))
        else:  # not even the emptiest micro-batch has room: open a new one
            bins.append([i])
            push(heap, (n, len(bins) - 1))
    return [sorted(b) for b in bins]


def allocate_for_ranks(lengths: Sequence[int], max_tokens: int, dp_size: int = 1,
                       min_per_rank: int = 1) -> list[list[list[int]]]:
    """`allocate`, then the micro-batches dealt to `dp_size` ranks: result[rank] = micro-batches.

    Every rank gets the same number of micro-batches; token loads are balanced by dealing the
    heaviest micro-batch first to the least-loaded rank that still has a free slot.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    bins = allocate(lengths, max_tokens, min_count=dp_size * max(1, min_per_rank))
    while len(bins) % dp_size:
        # More initial micro-batches only spreads the same sequences wider; retry at the next
        # multiple (the count never needs to exceed it, but loop in case the packing shifts).
        bins = allocate(lengths, max_tokens, min_count=-(-len(bins) // dp_size) * dp_size)
    per_rank = len(bins) // dp_size
    lens = np.asarray(lengths, dtype=np.int64)
    load = [int(lens[b].sum()) if b else 0 for b in bins]
    order = sorted(range(len(bins)), key=lambda b: (-load[b], b))
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    heap = [(0, r) for r in range(dp_size)]
    for b in order:
        tokens, r = heapq.heappop(heap)
        ranks[r].append(bins[b])
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (tokens + load[b], r))
    return ranks


def fixed_size_batches(n_seqs: int, seqs_per_mb: int) -> list[list[int]]:
    """The naive baseline: consecutive groups of `seqs_per_mb` sequences (for benchmarks)."""
    return [list(range(i, min(i + seqs_per_mb, n_seqs))) for i in range(0, n_seqs, seqs_per_mb)]


def pack(seqs: Sequence[np.ndarray], fields: dict[str, Sequence[np.ndarray]] | None = None,
         seq_index: Sequence[int] | None = None) -> PackedBatch:
    """Concatenate token sequences (and their aligned per-token fields) without padding."""
    lens = [len(s) for s in seqs]
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    ids = np.concatenate(seqs).astype(np.int64) if seqs else np.zeros(0, np.int64)
    # position = flat index - start of its sequence
    starts = np.repeat(cu[:-1], lens)
    pos = np.arange(total, dtype=np.int64) - starts
    out_fields = {}
    for name, arrays in (fields or {}).items():
        if len(arrays) != len(seqs):
            raise ValueError(f"field {name!r} has {len(arrays)} entries for {len(seqs)} sequences")
        for k, (a, n) in enumerate(zip(arrays, lens, strict=True)):
            if len(a) != n:
                raise ValueError(f"field {name!r} of sequence {k} has {len(a)} values for {n} tokens")
        out_fields[name] = torch.from_numpy(np.concatenate(arrays)) if arrays else torch.zeros(0)
    return PackedBatch(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(pos),
                       cu_seqlens=torch.from_numpy(cu.astype(np.int32)), fields=out_fields,
                       seq_index=list(seq_index if seq_index is not None else range(len(seqs))))
