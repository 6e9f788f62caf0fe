"""A left-padded rectangle of KV-cache rows that decodes in place.

transformers' models take a `Cache` of per-layer key/value tensors for a rectangular batch.
Continuous batching needs rows of different lengths that come and go, so the rows are kept
left-padded: every row ends at the same column, where its next token goes, and a 2-D attention
mask hides each row's padding (explicit position ids keep each row's positions its own).

A paged server (SGLang) pays per request for a join or a leave and per held token for a decode
step. A naive rectangular batch pays for the whole batch on each: transformers' `DynamicLayer`
concatenates (copies) the cache to add every step's column, and dropping or adding one row
copies every other row. On a long-tailed batch of ~80 rows that made joins and leaves half of
the server's time. So the rows live in preallocated buffers [row capacity, kv_heads, column
capacity, head_dim] per layer:
- a decode step writes its column in place (`_StepLayer`);
- a joining row is written into a free row slot, a leaving row's slot is filled by the last row
  (`remove` returns the new row order), and the all-padding prefix is dropped by moving a start
  column, not by copying;
- buffers are reallocated only when they run out of rows or columns, with room to spare.
What stays is the rectangle: a step attends over every row padded to the longest
(`kv_batch.py` keeps long rows apart for that).

The buffers are made like the prefilled rows (`new_zeros`), so they live on the model's
device; the masks, positions and row indices are made on that device too.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

SPARE_COLUMNS = 64   # columns beyond the current need when a buffer is (re)allocated


def with_cache(model, cache: Cache) -> dict:
    """The keyword under which `model`'s forward takes the KV cache, with `cache`: `cache`
    where it declares one (transformers 5 renamed it: the installed 5.24 warns that
    `past_key_values` goes in 5.40, which setup.cfg's range allows), else `past_key_values`
    (the releases before)."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@dataclass
class RowKV:
    """One row's keys and values, per layer [kv_heads, length, head_dim]."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    @classmethod
    def of_cache(cls, cache, length: int) -> RowKV:
        """A single-sequence transformers cache (batch of 1) as a row."""
        return cls([layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers], length)


class _StepLayer(DynamicLayer):
    """One layer of one decode step: attends over the live rows' valid columns and writes the
    step's new column straight into the batch's buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lo: int, hi: int):
        super().__init__()
        self._buffers, self._lo, self._hi = (keys, values), lo, hi
        self.keys, self.values = keys[:, :, lo:hi], values[:, :, lo:hi]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self._buffers
        end = self._hi + key_states.shape[2]
        keys[:, :, self._hi:end] = key_states
        values[:, :, self._hi:end] = value_states
        self.keys, self.values = keys[:, :, self._lo:end], values[:, :, self._lo:end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2]


class RowBuffer:
    """One left-padded rectangle of rows in preallocated per-layer buffers."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []     # per layer: [row capacity, kv_heads, column capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []           # valid positions per live row (rows 0..size-1)
        self.lo = self.hi = 0                  # valid columns [lo, hi): hi - lo = the longest row

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.hi - self.lo

    def clear(self) -> None:
        self.keys, self.values, self.lengths, self.lo, self.hi = [], [], [], 0, 0

    def add_rows(self, joining: list[RowKV]) -> None:
        """Append rows after the live ones (copying only them)."""
        if not joining:
            return
        n, width = self.size, max([self.width] + [row.length for row in joining])
        self._make_room(n + len(joining), width, 1, like=joining[0].keys)
        self.lo = self.hi - width
        for slot, row in enumerate(joining, start=n):
            for buffers, tensors in ((self.keys, row.keys), (self.values, row.values)):
                for buf, t in zip(buffers, tensors, strict=True):
                    buf[slot, :, self.hi - row.length:self.hi] = t
        self.lengths += [row.length for row in joining]

    def row(self, i: int) -> RowKV:
        """A copy of row i's valid keys and values (to move it to another buffer)."""
        start = self.hi - self.lengths[i]
        return RowKV([k[i, :, start:self.hi].clone() for k in self.keys],
                     [v[i, :, start:self.hi].clone() for v in self.values], self.lengths[i])

    def remove(self, rows: list[int]) -> list[int]:
        """Drop rows; the last live rows move into the holes. Returns the new row order as old
        row indices (the caller reorders whatever it keeps per row the same way)."""
        gone = set(rows)
        keep = self.size - len(gone)
        holes = [i for i in sorted(gone) if i < keep]
        movers = [i for i in range(keep, self.size) if i not in gone]
        order = list(range(keep))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if holes:
            device = self.keys[0].device
            dst, src = torch.tensor(holes, device=device), torch.tensor(movers, device=device)
            for buf in self.keys + self.values:
                live = buf[:, :, self.lo:self.hi]
                live[dst] = live[src]
        self.lengths = [self.lengths[i] for i in order]
        self.lo = self.hi - max(self.lengths, default=0)
        return order

    def decode(self, model, ids: torch.Tensor) -> torch.Tensor:
        """One decode step of every row (ids [B, 1]); the last position's logits [B, vocab]."""
        n, width = self.size, self.width
        self._make_room(n, width, 1)
        # Masks and positions on the ids' device: the model's (engine.py makes the ids there).
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=ids.device)
        mask = (torch.arange(width + 1, device=ids.device).unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        cache = Cache(layers=[_StepLayer(k[:n], v[:n], self.lo, self.hi)
                              for k, v in zip(self.keys, self.values, strict=True)])
        logits = model(input_ids=ids, attention_mask=mask, position_ids=lengths.unsqueeze(1),
                       **with_cache(model, cache), use_cache=True).logits[:, -1]
        self.hi += 1
        self.lengths = [length + 1 for length in self.lengths]
        return logits

    def _make_room(self, rows: int, width: int, extra: int, like: list[torch.Tensor] | None = None) -> None:
        # `like`: one [kv_heads, length, head_dim] tensor per layer (shape, dtype, device)
        """Buffers with at least `rows` rows and `width` valid columns ending at `hi` followed by
        `extra` free ones; reallocated (live rows copied once) only when that does not fit.
        New buffers start zeroed: masked columns must hold finite numbers (0 x NaN is NaN)."""
        if self.keys:
            capacity, like = self.keys[0].shape, [k[0] for k in self.keys]
            if rows <= capacity[0] and self.hi - width >= 0 and self.hi + extra <= capacity[2]:
                return
            row_capacity = capacity[0] if rows <= capacity[0] else max(rows, 2 * capacity[0])
        else:
            row_capacity = rows
        kept = self.width
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = [t.new_zeros(row_capacity, t.shape[0], width + extra + SPARE_COLUMNS, t.shape[2]) for t in like]
            if self.size:
                for o, b in zip(old, new, strict=True):
                    b[:self.size, :, width - kept:width] = o[:self.size, :, self.lo:self.hi]
            setattr(self, name, new)
        self.lo, self.hi = width - kept, width
