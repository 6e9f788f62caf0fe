"""Advantages without a critic: gamma = lambda = 1, so every output token of a sample gets the
sample's (baselined) reward.

The group-mean baseline (GRPO-style) turns "was this answer right" into "was it better than
the other answers to the same prompt", which removes per-prompt difficulty from the signal.
Normalisation over the global batch then fixes the scale, so the learning rate means the same
thing whatever the reward values. Because the advantage is constant within a sequence, the
token-level mean and std are the length-weighted mean and std over sequences: computed here
once per sequence, broadcast to tokens by the caller.

The variants (docs/algorithms.md), for sample i of group g with n samples and reward r_i:

    group mean (GRPO, default)   b_i = (1/n) sum_{j in g} r_j
    leave-one-out (RLOO)         b_i = (1/(n-1)) sum_{j in g, j != i} r_j     (n = 1: b_i = r_i)
    normalisation "batch"        A = (a - mean) / (std + eps) over all output tokens of the batch
                                 (default; AReaL's adv_norm at batch level)
    normalisation "group"        A_i = a_i / (std_g + eps), std_g the standard deviation of the
                                 group's rewards (GRPO, DeepSeekMath); a group of one is not scaled

    `std` ("sample" or "population", trainer.adv_norm_std) is the convention of both: sample
    divides the sum of squares by (count - 1) — AReaL v1.0.3's NormConfig.std_unbiased default,
    over tokens; verl's and TRL's torch.std, over a group's rewards — population by count.
    no normalisation             A = r - b (Dr. GRPO: the std division biases towards groups
                                 that are almost all right or all wrong)

Multi-turn episodes (`turn_credit`, trainer/batch.py): a trajectory that carries `turn_rewards`
(one per model turn, the reward of the program or answer that turn wrote) is split into its
model turns, and each turn is a "sequence" of this module whose group is (prompt group, turn
index): turn k of a sample is baselined against turn k of the group's other samples that got
that far. The first turn then has single-turn GRPO's baseline on the first attempts; a revision is
compared only with the other revisions of the same problem (a lone revision is its own
baseline: no signal, like a group whose samples all agree). The credit is myopic on purpose: a
wrong first attempt is never paid for what a later turn made of its feedback.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sequence_advantages(rewards: Sequence[float], group_ids: Sequence[str], output_lens: Sequence[int],
                        group_baseline: bool = True, normalize: bool = True, eps: float = 1e-5,
                        leave_one_out: bool = False, norm_scope: str = "batch", std: str = "sample"
                        ) -> np.ndarray:
    """Per-sequence advantage (float64); every output token of sequence i gets result[i].

    group_baseline: subtract the mean reward of the sequence's group (all its samples).
    normalize: then subtract the mean and divide by the std over all output tokens of the batch;
    a batch with zero spread (or a single token, under the sample std) is only centred.
    leave_one_out: the baseline excludes the sample itself (RLOO; only with group_baseline).
    norm_scope: "batch" (above) or "group": divide by the group's reward std + eps.
    std: "sample" (ddof 1) or "population" (ddof 0), for either scope.
    """
    r = np.asarray(rewards, dtype=np.float64)
    lens = np.asarray(output_lens, dtype=np.float64)
    if not (len(r) == len(group_ids) == len(lens)):
        raise ValueError(f"rewards ({len(r)}), group_ids ({len(group_ids)}) and output_lens "
                         f"({len(lens)}) must have one entry per sequence")
    if norm_scope not in ("batch", "group"):
        raise ValueError(f"norm_scope must be 'batch' or 'group', got {norm_scope!r}")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    ddof = 1 if std == "sample" else 0
    adv = r.copy()
    keys = {g: k for k, g in enumerate(dict.fromkeys(group_ids))}
    idx = np.array([keys[g] for g in group_ids], dtype=np.int64)
    sums = np.bincount(idx, weights=r, minlength=len(keys))
    counts = np.bincount(idx, minlength=len(keys))
    if group_baseline and leave_one_out:
        others = np.maximum(counts[idx] - 1, 1)
        adv = np.where(counts[idx] > 1, r - (sums[idx] - r) / others, 0.0)
    elif group_baseline:
        adv = r - (sums / counts)[idx]
    if normalize and norm_scope == "group":
        means = sums / counts
        sq = np.bincount(idx, weights=(r - means[idx]) ** 2, minlength=len(keys))
        group_std = np.sqrt(sq / np.maximum(counts - ddof, 1))
        return np.where(counts[idx] > 1, adv / (group_std[idx] + eps), adv)
    n_tokens = lens.sum()
    if normalize and n_tokens > 0:
        mean = float((adv * lens).sum() / n_tokens)
        sq = float((((adv - mean) ** 2) * lens).sum())
        var = sq / (n_tokens - ddof) if n_tokens > ddof else 0.0
        adv = adv - mean
        if var > eps * eps:
            adv = adv / (np.sqrt(var) + eps)
    return adv


def model_turns(mask: np.ndarray | None, n: int) -> np.ndarray:
    """Turn index of each of `n` output tokens: model turn k is the k-th run of mask-1 tokens
    (a multi-turn episode's turns are separated by the environment's mask-0 tokens); environment
    tokens get -1. No mask: one turn, every token."""
    if mask is None:
        return np.zeros(n, dtype=np.int64)
    m = np.asarray(mask, dtype=bool)
    starts = m & ~np.concatenate([[False], m[:-1]])
    return np.where(m, np.cumsum(starts) - 1, -1)
