"""What every weight-sync method shares on the trainer's side: the publisher interface.

A publisher makes a new policy version available to the generation servers and returns the
protocol message that tells the controller how to fetch it (one message type per method), plus,
when the transfer happens while the controller drives the servers (a broadcast), the call that
performs it. The trainer loop then sends the message and waits for the ack the same way for
every method.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:   # the simulator reads METHODS without importing torch
    from tandem.trainer.backend import TrainBackend


@dataclass
class Publication:
    """One published version. `message` is only meaningful on rank 0 (the one that sends it)."""
    message: Any
    # Seconds spent per phase on this rank (export, rename, ...).
    timings: dict = field(default_factory=dict)
    # Runs while the controller applies `message` (rank 0 only); returns its timings.
    transfer: Callable[[], dict] | None = None


class WeightPublisher(ABC):
    # How the simulator prices the method: "filesystem" (the trainer writes one copy, every
    # server reads one through the shared filesystem) or "network" (one transfer from the
    # trainer to all servers at network bandwidth).
    transfer_path: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, tcfg, weights_root: Path, receiver_ranks: int) -> WeightPublisher:
        """Build from the trainer config; `receiver_ranks` = the generation servers' TP ranks
        in all, `weights_root` = `<exp>/weights`."""

    @abstractmethod
    def publish(self, backend: TrainBackend, version: int) -> Publication:
        """Make `version` available. Collective: every trainer rank calls it."""


class BackgroundCall:
    """Run a function in a thread; `result()` joins and re-raises its exception."""

    def __init__(self, fn: Callable[[], dict], name: str = "background call"):
        self.name = name
        self._out: dict = {}
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=name)
        self._thread.start()

    def _run(self, fn):
        try:
            self._out = fn()
        except BaseException as e:  # handed to the caller in result()
            self._err = e

    def result(self, timeout_s: float | None = None) -> dict:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not finish in time")
        if self._err is not None:
            raise self._err
        return self._out
