"""Sample-level data shaping before advantages: DAPO's soft overlong penalty and the masking of
truncated samples. (Dynamic sampling — dropping groups whose rewards are all equal — happens in
the rollout workflow, `rollout.filter_all_equal`; see docs/algorithms.md.)

Where truncation is known: every trajectory carries the generation server's `finish_reason`,
"stop" when the model emitted EOS (or a stop token/string, which Tandem's workflows never set)
and "length" when it ran into `rollout.max_new_tokens` (an interrupted request is resumed, so
"abort" never reaches the trainer). A sample "without EOS" and a "truncated" sample are
therefore the same set here: finish_reason != "stop".
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def overlong_penalty(output_lens: Sequence[int], max_len: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment, added to each sample's reward (float64, <= 0).

    With L = max_len, B = buffer and |y| the output length:

        R(y) = 0                                 |y| <= L - B
        R(y) = factor * ((L - B) - |y|) / B      L - B < |y| <= L     (linear from 0 to -factor)
        R(y) = -factor                           |y| > L
    buffer = 0 turns it off (all zeros).
    """
    lens = np.asarray(output_lens, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(lens)
    start = float(max_len - buffer)
    return -factor * np.clip((lens - start) / float(buffer), 0.0, 1.0)


def keep_samples(finish_reasons: Sequence[str], mask_truncated: bool) -> np.ndarray:
    """True for each sample that trains; with mask_truncated, False for every sample whose
    finish_reason is not "stop" (it hit the length limit before EOS: DAPO's overlong filtering)."""
    reasons = list(finish_reasons)
    if not mask_truncated:
        return np.ones(len(reasons), dtype=bool)
    return np.array([r == "stop" for r in reasons], dtype=bool)
