"""Advantages without a critic: gamma = lambda = 1, so every output token of a sample gets the
sample's (baselined) reward.

The group-mean baseline (GRPO-style) turns "was this answer right" into "was it better than
the other answers to the same prompt", which removes per-prompt difficulty from the signal.
Normalisation over the global batch then fixes the scale, so the learning rate means the same
thing whatever the reward values. Because the advantage is constant within a sequence, the
token-level mean and std are the length-weighted mean and std over sequences: computed here
once per sequence, broadcast to tokens by the caller.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sequence_advantages(rewards: Sequence[float], group_ids: Sequence[str], output_lens: Sequence[int],
                        group_baseline: bool = True, normalize: bool = True, eps: float = 1e-5
                        ) -> np.ndarray:
    """Per-sequence advantage (float64); every output token of sequence i gets result[i].

    group_baseline: subtract the mean reward of the sequence's group (all its samples).
    normalize: then subtract the mean and divide by the std (population) over all output
    tokens of the batch; a batch with zero spread is only centred (no division by ~0).
    """
    r = np.asarray(rewards, dtype=np.float64)
    lens = np.asarray(output_lens, dtype=np.float64)
    if not (len(r) == len(group_ids) == len(lens)):
        raise ValueError(f"rewards ({len(r)}), group_ids ({len(group_ids)}) and output_lens "
                         f"({len(lens)}) must have one entry per sequence")
    adv = r.copy()
    if group_baseline:
        keys = {g: k for k, g in enumerate(dict.fromkeys(group_ids))}
        idx = np.array([keys[g] for g in group_ids], dtype=np.int64)
        sums = np.bincount(idx, weights=r, minlength=len(keys))
        counts = np.bincount(idx, minlength=len(keys))
        adv = r - (sums / counts)[idx]
    if normalize and lens.sum() > 0:
        mean = float((adv * lens).sum() / lens.sum())
        var = float((((adv - mean) ** 2) * lens).sum() / lens.sum())
        adv = adv - mean
        if var > eps * eps:
            adv = adv / (np.sqrt(var) + eps)
    return adv
