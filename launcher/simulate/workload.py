"""Output lengths of the simulated samples: the long tail is what makes synchronous RL wait.

A lognormal (median, sigma) clipped at max_new_tokens gives the typical reasoning-model shape:
most answers short, a few running into the limit. `empirical:PATH` resamples the lengths a real
run produced, read from records with an `output_tokens` field (a metrics.jsonl, a trajectory
dump, or every *.jsonl under an experiment directory). `grow_lengths` makes them lengthen over
the run (`simulate.length_growth`), as reasoning models' answers do during RL.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tandem.launcher.config import ConfigError


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


def grow_lengths(lengths: np.ndarray, growth: float, max_new_tokens: int, used: int,
                 span: tuple[float, float] = (0.0, 1.0)) -> np.ndarray:
    """Lengths that grow over a run: sample i of the `used` ones a run admits (admission order)
    times growth ** (a + (b - a) * i / used), clipped to max_new_tokens; span (a, b) = (0, 1) is
    a whole run, a part of it is a phase of one (launcher/simulate/elastic.py).

    Applied where a run consumes its lengths, not where they are drawn: a sweep shares one draw
    between configurations that consume different numbers of samples (a shrunk slice uses 1/k of
    them), and each must see the whole growth over its own run. growth == 1 returns `lengths`
    itself, so results without growth stay bit-identical."""
    a, b = span
    if growth == 1.0 or used <= 0:
        return lengths
    n = min(used, len(lengths))
    out = np.array(lengths, dtype=np.int64)
    factor = growth ** (a + (b - a) * np.arange(n, dtype=np.float64) / used)
    out[:n] = np.clip(np.rint(out[:n] * factor), 1, max_new_tokens)
    return out
