"""Bringing every generation server to a new policy version: pause, update, continue.

Phases, each run on all servers at once (one slow server bounds the phase, not the sum):
  pause     `/pause_generation` (mode abort): in-flight requests return what they have; the
            generation client resubmits prompt + partial output, which waits at the server;
  update    disk: `/update_weights_from_disk` with the trainer's directory; broadcast:
            `/init_weights_update_group` (rank_offset 1.., the trainer is rank 0), then
            `/update_weights_from_distributed` while the trainer sends, then
            `/destroy_weights_update_group`; both stamp `weight_version` = the policy version;
  continue  `/continue_generation`.
A server that fails any phase is taken out of rotation and left paused (it must not serve
the old weights) and named in the result; it comes back once it holds the current version.
The caller serialises syncs (one lock) and owns the version number.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.client import AdminClient, AdminError
from services.protocol import WeightsReady

from .registry import GenServer, ServerRegistry

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    version: int
    # address -> why it failed (those servers are out of rotation now)
    failed: dict[str, str] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


def check_ready(ready: WeightsReady) -> None:
    """Raise ValueError naming what is wrong with a weights_ready message."""
    if ready.version < 0:
        raise ValueError(f"weights_ready: version must be >= 0, got {ready.version}")
    if ready.how == "disk":
        if not ready.path:
            raise ValueError("weights_ready: how=disk needs `path` (a Hugging Face directory)")
        return
    missing = [k for k in ("group_name", "master_address") if not getattr(ready, k)]
    if missing or ready.master_port <= 0 or ready.world_size < 2:
        raise ValueError(f"weights_ready: how=broadcast needs group_name, master_address, master_port > 0 and "
                         f"world_size >= 2 (missing/invalid: {missing or 'master_port/world_size'})")
    n = len(ready.names or [])
    if n == 0 or len(ready.dtypes or []) != n or len(ready.shapes or []) != n:
        raise ValueError(f"weights_ready: names, dtypes and shapes must be non-empty lists of equal length "
                         f"(got {n}, {len(ready.dtypes or [])}, {len(ready.shapes or [])})")


class WeightSync:
    def __init__(self, registry: ServerRegistry, admin_for: Callable[[GenServer], AdminClient],
                 update_timeout_s: float = 600.0, broadcast_backend: str = "gloo", interruptible: bool = True):
        self.registry = registry
        self.admin_for = admin_for
        self.timeout_s = update_timeout_s
        self.backend = broadcast_backend
        # False: no pause; the update itself waits for in-flight requests to finish under the old
        # weights (SGLang's behaviour without a pause) — the non-interruptible baseline.
        self.interruptible = interruptible

    async def apply(self, ready: WeightsReady) -> SyncResult:
        check_ready(ready)
        t_start = time.perf_counter()
        result = SyncResult(ready.version)
        targets = []
        for s in self.registry.servers.values():
            if s.healthy:
                targets.append(s)
            else:
                self._fail(result, s, f"unhealthy during the update to v{ready.version}; will be caught up")
        if ready.how == "broadcast":
            receivers = targets[:ready.world_size - 1]
            for s in targets[ready.world_size - 1:]:
                self._fail(result, s, f"not in the broadcast group of v{ready.version} (world_size "
                                      f"{ready.world_size}); will be caught up")
            if len(receivers) < ready.world_size - 1:
                for s in receivers:
                    self._fail(result, s, f"broadcast of v{ready.version} needs {ready.world_size - 1} "
                                          f"receivers, only {len(receivers)} healthy servers")
                receivers = []
            targets = receivers
        live = (await self._phase(result, "pause", targets, lambda a: a.pause_generation("abort", self.timeout_s))
                if self.interruptible else targets)
        if ready.how == "disk":
            live = await self._phase(result, "update", live, lambda a: a.update_weights_from_disk(
                ready.path, ready.version, timeout_s=self.timeout_s))
        else:
            live = await self._broadcast(result, ready, live)
        for s in live:
            s.bring_back(ready.version)
        result.updated = [s.address for s in live]
        if self.interruptible:
            await self._phase(result, "continue", live, lambda a: a.continue_generation(self.timeout_s))
        result.seconds = time.perf_counter() - t_start
        return result

    async def _broadcast(self, result: SyncResult, ready: WeightsReady, servers: list[GenServer]) -> list[GenServer]:
        """Every receiver must join, or the collective cannot complete for anyone."""
        rank = {s.address: 1 + i for i, s in enumerate(servers)}
        joined = await self._phase(result, "init_group", servers, lambda a: a.init_weights_update_group(
            ready.master_address, ready.master_port, rank[a.url], ready.world_size, ready.group_name,
            self.backend, timeout_s=self.timeout_s))
        if len(joined) < len(servers):
            for s in joined:
                self._fail(result, s, "another receiver could not join the broadcast group")
            return []
        live = await self._phase(result, "update", joined, lambda a: a.update_weights_from_distributed(
            ready.names, ready.dtypes, ready.shapes, ready.group_name, ready.version, timeout_s=self.timeout_s))
        await self._phase(result, "destroy_group", joined,
                          lambda a: a.destroy_weights_update_group(ready.group_name, timeout_s=self.timeout_s),
                          fatal=False)
        return live

    async def catch_up(self, server: GenServer, version: int, path: str) -> SyncResult:
        """Bring one lagging server to `version` from the directory `path` (then it rejoins)."""
        return await self.apply_to([server], WeightsReady(version=version, how="disk", path=path))

    async def apply_to(self, servers: list[GenServer], ready: WeightsReady) -> SyncResult:
        check_ready(ready)
        t0 = time.perf_counter()
        result = SyncResult(ready.version)
        live = await self._phase(result, "pause", servers, lambda a: a.pause_generation("abort", self.timeout_s))
        live = await self._phase(result, "update", live, lambda a: a.update_weights_from_disk(
            ready.path, ready.version, timeout_s=self.timeout_s))
        for s in live:
            s.bring_back(ready.version)
        result.updated = [s.address for s in live]
        await self._phase(result, "continue", live, lambda a: a.continue_generation(self.timeout_s))
        result.seconds = time.perf_counter() - t0
        return result

    async def _phase(self, result: SyncResult, name: str, servers: list[GenServer], call,
                     fatal: bool = True) -> list[GenServer]:
        """Run `call(admin)` on every server at once; return those that succeeded."""
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(call(self.admin_for(s)) for s in servers), return_exceptions=True)
        result.phases[name] = result.phases.get(name, 0.0) + time.perf_counter() - t0
        ok = []
        for s, out in zip(servers, outcomes, strict=True):
            if isinstance(out, BaseException):
                detail = out.detail if isinstance(out, AdminError) else f"{type(out).__name__}: {out}"
                if fatal:
                    self._fail(result, s, f"{name} failed for v{result.version}: {detail}")
                else:
                    log.warning("%s: %s failed (ignored): %s", s.address, name, detail)
                    ok.append(s)
            else:
                ok.append(s)
        return ok

    @staticmethod
    def _fail(result: SyncResult, server: GenServer, reason: str) -> None:
        server.take_out(reason)
        result.failed[server.address] = reason
        log.error("generation server %s out of rotation: %s", server.address, reason)
