"""The running batch's KV cache: rows join and leave between decode steps.

transformers' models take a `DynamicCache` for a rectangular batch. Continuous batching needs
rows of different lengths that come and go, so this class keeps the per-layer key/value tensors
itself, left-padded to a common length, and hands the model a fresh `DynamicCache` view of them
for each step (a 2-D attention mask hides the padding; explicit position ids keep each row's
positions its own). A joining row is padded (or the batch is) to the common length; leaving rows
are dropped and the all-padding prefix trimmed, so memory follows the longest live row.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


class KVBatch:
    def __init__(self, config):
        self.config = config
        self.keys: list[torch.Tensor] = []     # per layer: [B, kv_heads, L, head_dim]
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []           # valid (right-aligned) positions per row

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def clear(self) -> None:
        self.keys, self.values, self.lengths = [], [], []

    def add_many(self, joining: list[tuple[DynamicCache, int]]) -> None:
        """Append several single-sequence caches as rows in one copy of the batch.

        Joining one row at a time re-pads and copies the whole batch per row, which is quadratic
        when a weight update re-admits every held request; one copy per admission round is not.
        """
        if not joining:
            return
        width = max([self.width] + [length for _, length in joining])
        n_layers = len(joining[0][0].layers)
        for attr in ("keys", "values"):
            merged = []
            for layer in range(n_layers):
                parts = [_left_pad(getattr(self, attr)[layer], width)] if self.lengths else []
                parts += [_left_pad(getattr(c.layers[layer], attr), width) for c, _ in joining]
                merged.append(torch.cat(parts, 0) if len(parts) > 1 else parts[0])
            setattr(self, attr, merged)
        self.lengths += [length for _, length in joining]

    def remove(self, rows: list[int]) -> None:
        """Drop rows (indices into the current batch); later rows shift down."""
        if not rows:
            return
        keep = [i for i in range(self.size) if i not in set(rows)]
        if not keep:
            self.clear()
            return
        index = torch.tensor(keep, dtype=torch.long)
        self.lengths = [self.lengths[i] for i in keep]
        trim = self.width - max(self.lengths)
        self.keys = [k.index_select(0, index)[:, :, trim:] for k in self.keys]
        self.values = [v.index_select(0, index)[:, :, trim:] for v in self.values]

    def step_inputs(self) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """A cache view, the attention mask [B, L+1] and position ids [B, 1] for one decode step."""
        cache = DynamicCache(config=self.config)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.update(k, v, layer)
        width = self.width
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        cols = torch.arange(width + 1).unsqueeze(0)
        mask = (cols >= (width - lengths).unsqueeze(1)).long()
        return cache, mask, lengths.unsqueeze(1)

    def absorb(self, cache: DynamicCache) -> None:
        """Take the step's grown tensors back (each row gained one position)."""
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.lengths = [n + 1 for n in self.lengths]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    if missing <= 0:
        return t
    pad = t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3])
    return torch.cat([pad, t], 2)
