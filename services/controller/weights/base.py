"""What every weight-sync method shares on the controller's side: the applier interface, and one
sync in progress (its result and the phase runner).

An applier supplies only the *update* of a sync: given the servers (already paused when the
sync interrupts generation) it makes them hold the new version. The pause -> update ->
continue sequence around it is written once, in `services/controller/weight_sync.py`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from tandem.rollout.client import AdminClient, AdminError
from tandem.services.config import ControllerConfig

from ..registry import RegisteredServer

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    version: int
    # address -> why it failed (those servers are out of rotation now)
    failed: dict[str, str] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # node -> why its weight relay failed (its servers then read the shared directory).
    relay_fallback: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


class SyncRun:
    """One sync in progress: runs phases on many servers at once and records who failed."""

    def __init__(self, version: int, admin_for: Callable[[RegisteredServer], AdminClient], timeout_s: float,
                 flush_cache: bool = True):
        self.result = SyncResult(version)
        self.admin_for = admin_for
        self.timeout_s = timeout_s
        # False under an `in_place` pause: running requests keep their KV cache across the update.
        self.flush_cache = flush_cache

    @property
    def version(self) -> int:
        return self.result.version

    async def phase(self, name: str, servers: list[RegisteredServer], call: Callable[[AdminClient], Awaitable],
                    fatal: bool = True) -> list[RegisteredServer]:
        """Run `call(admin)` on every server at once (one slow server bounds the phase, not the
        sum); return those that succeeded. `fatal`: a server that fails leaves the rotation."""
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(call(self.admin_for(s)) for s in servers), return_exceptions=True)
        self.result.phases[name] = self.result.phases.get(name, 0.0) + time.perf_counter() - t0
        ok = []
        for s, out in zip(servers, outcomes, strict=True):
            if isinstance(out, BaseException):
                detail = out.detail if isinstance(out, AdminError) else f"{type(out).__name__}: {out}"
                if fatal:
                    self.fail(s, f"{name} failed for v{self.version}: {detail}")
                    continue
                log.warning("%s: %s failed (ignored): %s", s.address, name, detail)
            ok.append(s)
        return ok

    def fail(self, server: RegisteredServer, reason: str) -> None:
        """Take `server` out of rotation (it is left paused: it must not serve the old weights).
        A server failing twice in one sync keeps the first reason (the cause, not its echo)."""
        if server.address in self.result.failed:
            return
        server.take_out(reason)
        self.result.failed[server.address] = reason
        log.error("generation server %s out of rotation: %s", server.address, reason)


class WeightApplier(ABC):
    """Brings paused servers to the version one protocol message describes."""

    # The protocol message (services/protocol/control.py) this applier handles.
    message: ClassVar[type]
    # True when the same message can later bring one lagging server to that version (the
    # weights still exist, e.g. on disk); False when it describes a one-time transfer.
    replayable: ClassVar[bool] = False
    # The pause this method needs whatever `controller.interruptible` / `interrupt_mode` say
    # (None: the config's); see weights/adapter.py for why adapters need an abort pause.
    pause_mode: ClassVar[str | None] = None

    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg

    @abstractmethod
    def check(self, msg) -> None:
        """Raise ValueError naming what is wrong with `msg`."""

    async def receivers(self, run: SyncRun, servers: list[RegisteredServer], msg) -> list[RegisteredServer]:
        """The servers that take part (the others are failed in `run` with the reason)."""
        return servers

    @abstractmethod
    async def update(self, run: SyncRun, servers: list[RegisteredServer], msg) -> list[RegisteredServer]:
        """Load the new weights on `servers`, stamping `msg.version`; return those that hold it."""
