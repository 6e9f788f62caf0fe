"""The running batch's KV cache: rows join and leave between decode steps; long rows decode apart.

Two left-padded rectangles (`kv_rows.RowBuffer`): the batch's rows, and the rows that grew
long while others joined (`cohorts.py` says which and why). The engine sees one batch: rows in
order (the first rectangle's, then the long ones'), one decode step for all, and the new row
order whenever rows join or leave, so it keeps its per-row state in the same order.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .cohorts import rows_to_set_apart
from .kv_rows import RowBuffer, RowKV


class KVBatch:
    def __init__(self):
        self.batch, self.long = RowBuffer(), RowBuffer()

    @property
    def size(self) -> int:
        return self.batch.size + self.long.size

    @property
    def lengths(self) -> list[int]:
        return self.batch.lengths + self.long.lengths

    @property
    def width(self) -> int:
        return max(self.batch.width, self.long.width)

    @property
    def passes(self) -> int:
        """Forward passes a decode step takes (one per non-empty rectangle)."""
        return (self.batch.size > 0) + (self.long.size > 0)

    @property
    def padded_entries(self) -> int:
        """KV entries a decode step attends over: every row padded to its rectangle's longest."""
        return self.batch.size * self.batch.width + self.long.size * self.long.width

    def clear(self) -> None:
        self.batch.clear()
        self.long.clear()

    def add_many(self, joining: list[tuple[DynamicCache, int]]) -> list[int]:
        """Add prefilled single-sequence caches as rows (copying only them), first moving rows
        that grew long apart. Returns the new row order as indices into (current rows + joining)."""
        n_batch, n = self.batch.size, self.size
        apart = rows_to_set_apart(self.batch.lengths, [length for _, length in joining])
        moved = [self.batch.row(i) for i in apart]
        batch_order = self.batch.remove(apart)
        self.long.add_rows(moved)
        self.batch.add_rows([RowKV.of_cache(cache, length) for cache, length in joining])
        return [*batch_order, *range(n, n + len(joining)), *range(n_batch, n), *apart]

    def remove(self, rows: list[int]) -> list[int]:
        """Drop rows; the last rows of each rectangle move into its holes. Returns the new row
        order as old row indices."""
        n_batch = self.batch.size
        batch_order = self.batch.remove([i for i in rows if i < n_batch])
        long_order = self.long.remove([i - n_batch for i in rows if i >= n_batch])
        return [*batch_order, *(n_batch + i for i in long_order)]

    def decode(self, model, ids: torch.Tensor) -> torch.Tensor:
        """One decode step of every row (ids [B, 1], in row order); logits [B, vocab]."""
        n_batch = self.batch.size
        parts = [buf.decode(model, rows) for buf, rows in ((self.batch, ids[:n_batch]), (self.long, ids[n_batch:]))
                 if buf.size]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]
