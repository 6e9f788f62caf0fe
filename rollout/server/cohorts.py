"""Which running rows decode apart from the rest: the rule the engine and the simulator share.

A left-padded batch makes every row pay for the longest (`kv_rows.py`). In an asynchronous run
the running batch mixes rows that started long ago, and are long, with rows that just joined:
one 450-token row makes thirty 60-token rows attend over 450 columns each. Decoding the long
rows as a second, separate rectangle costs one more forward pass (about what attending over a
few thousand padded entries costs on a CPU) and saves the short rows their padding. Rows are
moved apart when a round of requests joins (the engine's admission), never back: they only grow.
Torch-free, so the simulator (`launcher/simulate`) prices the same split without loading torch.
"""
from __future__ import annotations

APART_RATIO = 2.0        # a row at least this many times the batch's median length moves apart
APART_MIN_TOKENS = 64    # ... and at least this long
APART_MIN_ROWS = 8       # ... when at least this many rows stay behind to stop paying for it


def rows_to_set_apart(lengths: list[int], joining: list[int] = ()) -> list[int]:
    """Indices into `lengths` (the rows decoding together) of the rows to decode apart, given
    the rows about to join them (`joining`, counted for the median, never moved)."""
    pool = sorted([*lengths, *joining])
    if not pool:
        return []
    bar = max(APART_RATIO * pool[len(pool) // 2], APART_MIN_TOKENS)
    apart = [i for i, n in enumerate(lengths) if n >= bar]
    return apart if len(pool) - len(apart) >= APART_MIN_ROWS else []
