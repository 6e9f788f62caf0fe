"""Where a rollout worker is in its data: a prompt is used up when its group is settled, not
when it is admitted. An accepted group settles when the trainer has receipted all of it (see
services/protocol/trajectory_channel.py), not when it was pushed: what a dying trainer never
got is generated again.

A worker runs many groups at once. Saving "the next prompt to issue" would skip every prompt in
flight when the worker dies (a crash, Ctrl-C past the drain), and saving "the first prompt
issued" would train the finished ones again. So the saved state is the lowest index not yet
settled plus the indices above it that are: a restarted worker issues exactly the prompts
nobody finished. A group that failed (no reward service, a lost server) gives its prompt back
for another try, up to `max_attempts` in all; after that the prompt counts as skipped, and the
count says so.
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from tandem.services.protocol import write_json_atomic


class DataPosition:
    def __init__(self, path: Path, max_attempts: int = 3):
        self.path, self.max_attempts = Path(path), max_attempts
        self.next_fresh = 0                      # the first index never issued
        self.settled_ahead: set[int] = set()     # settled indices at or above `low`
        self.in_flight: dict[int, int] = {}      # index -> attempts so far
        self.retry: deque[tuple[int, int]] = deque()   # (index, attempts) waiting to be issued again
        self.skipped = 0                         # prompts given up after max_attempts failures
        self._low = 0                            # every index below is settled
        if self.path.exists():
            state = json.loads(self.path.read_text())
            self._low = self.next_fresh = int(state["position"])
            self.settled_ahead = {int(i) for i in state.get("settled_ahead", ())}
            self.skipped = int(state.get("skipped", 0))
            self._advance_fresh()

    @property
    def position(self) -> int:
        """The lowest index not yet settled: where a restarted worker starts."""
        return self._low

    def issue(self) -> int:
        """The index of the prompt the next group gets: a failed one first, else a fresh one."""
        if self.retry:
            index, attempts = self.retry.popleft()
        else:
            index, attempts = self.next_fresh, 0
            self.next_fresh += 1
            self._advance_fresh()
        self.in_flight[index] = attempts + 1
        return index

    def settle(self, index: int, failed: bool = False) -> None:
        """The group of `index` ended; a failed one is retried while attempts remain."""
        attempts = self.in_flight.pop(index)
        if failed and attempts < self.max_attempts:
            self.retry.append((index, attempts))
            return
        self.skipped += failed
        self.settled_ahead.add(index)
        while self._low in self.settled_ahead:
            self.settled_ahead.discard(self._low)
            self._low += 1
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, {"position": self._low, "settled_ahead": sorted(self.settled_ahead),
                                      "skipped": self.skipped})

    def _advance_fresh(self) -> None:
        while self.next_fresh in self.settled_ahead:   # finished before a restart: never again
            self.next_fresh += 1
