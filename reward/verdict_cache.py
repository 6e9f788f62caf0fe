"""Identical items are graded once: the reward service remembers recent verdicts by content.

Why: the samples of a group repeat each other whenever the policy is confident (a tiny code
model at temperature 1 writes the same program in most of its eight samples), and a multi-turn
episode's revision can repeat the program it revises. Each repeat would cost a sandbox run —
the largest CPU cost of a code step — for a verdict already known. An item is the same when its
task, response, reference answer, question and tests are the same (and its row, where a user's
reward function reads it); an identical item that arrives while the first is still being
graded waits for that verdict instead of queuing again.

Only verdicts of the program or answer are kept: an error verdict (grader crashed or hung,
deadline passed, a user's reward function timed out or its endpoint failed:
`details["error"]`) is never cached, so infrastructure trouble is retried by the next
identical item. A program that behaves differently from run to run (randomness, time)
gets the verdict of its first run for every repeat: one draw of the same distribution.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Generic, TypeVar

import msgpack

from tandem.services.protocol import GradeItem

T = TypeVar("T")


def item_key(item: GradeItem, with_row: bool = False) -> bytes:
    """A digest of everything a verdict depends on: the row too where a user's reward function
    reads it (`with_row`); the built-in graders never do, so for them it would only split hits."""
    body = msgpack.packb([item.task, item.response, item.answer, item.question, item.tests,
                          item.row if with_row else None], use_bin_type=True)
    return hashlib.blake2b(body, digest_size=16).digest()


class VerdictCache(Generic[T]):
    """The last `size` grading jobs (of any type T with a `future`) by item key, least recently
    used evicted first; size 0 keeps nothing."""

    def __init__(self, size: int):
        self.size = size
        self._jobs: OrderedDict[bytes, T] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, key: bytes) -> T | None:
        job = self._jobs.get(key)
        if job is not None:
            self._jobs.move_to_end(key)
        return job

    def put(self, key: bytes, job: T, future: asyncio.Future) -> None:
        """Remember `job` (graded or being graded); it is forgotten again if `future` ends in an
        error verdict or is cancelled."""
        if self.size <= 0:
            return
        self._jobs[key] = job
        self._jobs.move_to_end(key)
        while len(self._jobs) > self.size:
            self._jobs.popitem(last=False)
        future.add_done_callback(lambda f: self._settled(key, job, f))

    def _settled(self, key: bytes, job: T, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None or "error" in future.result().details:
            if self._jobs.get(key) is job:
                del self._jobs[key]
