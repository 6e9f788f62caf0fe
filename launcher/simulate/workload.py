"""Output lengths of the simulated samples: the long tail is what makes synchronous RL wait.

A lognormal (median, sigma) clipped at max_new_tokens gives the typical reasoning-model shape:
most answers short, a few running into the limit. `empirical:PATH` resamples the lengths a real
run produced, read from records with an `output_tokens` field (a metrics.jsonl, a trajectory
dump, or every *.jsonl under an experiment directory).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from launcher.config import ConfigError


def read_output_lengths(path: str | Path) -> np.ndarray:
    """Every `output_tokens` (or len(`output_ids`)) found in JSON-lines records under path."""
    p = Path(path)
    files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    out: list[int] = []
    for f in files:
        try:
            lines = f.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"empirical lengths: cannot read {f}: {e}") from None
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            value = rec.get("output_tokens")
            if isinstance(value, int | float):
                out.append(int(value))
            elif isinstance(value, list):  # a rollout worker's group record: one per sample
                out.extend(int(v) for v in value if isinstance(v, int | float))
            elif isinstance(rec.get("output_ids"), list):
                out.append(len(rec["output_ids"]))
    if not out:
        raise ConfigError(f"empirical lengths: no record with `output_tokens` or `output_ids` in {p}")
    return np.asarray(out, dtype=np.int64)


def sample_lengths(spec: str, count: int, *, median: int, sigma: float, max_new_tokens: int,
                   seed: int) -> np.ndarray:
    """`count` output lengths in [1, max_new_tokens] drawn from the configured distribution."""
    rng = np.random.default_rng(seed)
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        x = np.full(count, median, dtype=np.float64)
    elif kind == "lognormal":
        x = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    elif kind == "empirical":
        x = rng.choice(read_output_lengths(arg), size=count, replace=True).astype(np.float64)
    else:
        raise ConfigError(f"simulate.output_lengths={spec!r}: must be lognormal, fixed or empirical:PATH")
    return np.clip(np.rint(x), 1, max_new_tokens).astype(np.int64)
