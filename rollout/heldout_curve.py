"""Held-out accuracy during training (`rollout.eval_every`): the curve that shows when learning
happened and whether it is still rising, between the before/after figures of a run.

Rollout worker 0 scores the same held-out problems greedily each time the policy version
passes a multiple of `eval_every`, beside its episodes (the run never waits for it; the
requests share the generation servers with rollouts, which is its cost). One evaluation at a
time: if the trainer moves on by more than `eval_every` versions while one runs, the versions
in between are skipped, not queued. Weights keep reaching the servers during an evaluation,
so its record names the oldest and newest version that wrote an answer.
"""
from __future__ import annotations

import asyncio
import logging

from .evaluation import eval_record, evaluate_prompts, held_out_prompts

log = logging.getLogger(__name__)


class HeldOutCurve:
    def __init__(self, cfg, generator, reward, tokenizer, metrics, version: int = 0):
        rc = cfg.rollout
        self.cfg, self.every = cfg, rc.eval_every
        self.generator, self.reward, self.tokenizer, self.metrics = generator, reward, tokenizer, metrics
        self.prompts = held_out_prompts(cfg, rc.eval_every_size or rc.eval_size) if self.every else []
        self.next_due = self._after(version)
        self.task: asyncio.Task | None = None

    def _after(self, version: int) -> int:
        return (version // self.every + 1) * self.every if self.every else 0

    def poll(self, version: int) -> None:
        """Start an evaluation when `version` reached the next point and none is running."""
        if not self.prompts or version < self.next_due or (self.task and not self.task.done()):
            return
        self.next_due = self._after(version)
        self.task = asyncio.ensure_future(self._evaluate(version))

    async def _evaluate(self, version: int) -> None:
        try:
            result = await evaluate_prompts(self.cfg, self.prompts, self.generator, self.reward, self.tokenizer,
                                            deadline_s=0.9 * self.cfg.rollout.reward_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a lost point on the curve, never a lost run
            log.warning("held-out evaluation at version %d failed: %s: %s", version, type(e).__name__, e)
            return
        log.info("held-out accuracy at version %d: %.3f ± %.3f (n=%d)", version, result["accuracy"],
                 result["se"], result["n"])
        # x = the version that triggered it, so the curve's points fall on multiples of eval_every.
        self.metrics.log(**{**eval_record(result, tag="during"), "step": version})

    async def close(self) -> None:
        if self.task and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
