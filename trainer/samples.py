"""Sample completions: what the model writes, every few steps, where the run's figures go.

A reward curve says how often the model is right, not what it writes; verl, TRL and OpenRLHF
all log a few completions for that. Every `trainer.samples.every` steps, rank 0 decodes `n` of
the step's trained samples (one per group, drawn with the run's seed) and writes a `samples`
record to metrics.jsonl: `{"event": "samples", "step", "samples": [{"prompt", "response",
"reward", "correct", "version_min", "version_max", "admit_version", "finish_reason",
"group_id", "sample_idx", "output_tokens"}]}` (`version_*`: the policy versions that wrote the
response's tokens). The tracker follower sends it on (a W&B table, TensorBoard text) and the
report shows the last ones; everything reads it from the file, as every other record.

Texts are cut to `max_chars` (the record says how long they were), so a run of long answers
does not grow metrics.jsonl by megabytes.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class SamplesConfig:
    """A few of the trained samples, decoded, every few steps (trainer/samples.py)."""
    # Every this many steps a `samples` record (prompt, response, reward, version) goes to
    # metrics.jsonl, TensorBoard (text), W&B (a table) and the report; 0 = off.
    every: int = 10
    # Samples per record: one from each of this many of the step's groups.
    n: int = 4
    # Characters kept of each prompt and each response (the record keeps their full lengths).
    max_chars: int = 2000

    def problems(self) -> list[tuple[str, str]]:
        return [(k, f"must be >= {low}, got {getattr(self, k)}")
                for k, low in (("every", 0), ("n", 1), ("max_chars", 1)) if getattr(self, k) < low]


def cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f" [... {len(text) - max_chars:,} more characters]"


class SampleLog:
    """Writes the `samples` records of rank 0. The tokenizer (experiment.model's) is loaded at
    the first record, so a run with samples off never loads it."""

    def __init__(self, cfg: SamplesConfig, model_dir: str, seed: int, metrics):
        self.cfg, self.model_dir, self.seed, self.metrics = cfg, model_dir, seed, metrics
        self._tokenizer = None

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def log(self, step: int, groups) -> list[dict] | None:
        """The record of step `step` (which trains `groups`) when one is due, written; else None."""
        if not self.due(step) or not groups:
            return None
        rng = random.Random(f"samples-{self.seed}-{step}")
        chosen = rng.sample(list(groups), min(self.cfg.n, len(groups)))
        rows = [self._row(g.group_id, rng.choice(g.samples)) for g in chosen]
        self.metrics.log(event="samples", step=step, samples=rows)
        return rows

    def _row(self, group_id: str, t) -> dict:
        tok = self.tokenizer()
        prompt = tok.decode(t.prompt_ids.tolist(), skip_special_tokens=True)
        response = tok.decode(t.output_ids.tolist(), skip_special_tokens=True)
        versions = t.output_versions.tolist() or [t.admit_version]
        return {"group_id": group_id, "sample_idx": int(t.sample_idx), "prompt": cut(prompt, self.cfg.max_chars),
                "response": cut(response, self.cfg.max_chars), "prompt_chars": len(prompt),
                "response_chars": len(response), "reward": float(t.reward),
                "correct": t.timings.get("correct"), "version_min": int(min(versions)),
                "version_max": int(max(versions)), "admit_version": int(t.admit_version),
                "finish_reason": t.finish_reason, "output_tokens": len(t.output_ids)}

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer
