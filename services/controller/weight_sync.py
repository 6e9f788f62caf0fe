"""Bringing generation servers to a new policy version: pause, update, continue -- written once.

Each phase runs on all servers at once (one slow server bounds the phase, not the sum):
  pause     `/pause_generation` in `controller.interrupt_mode`: abort (in-flight requests return
            what they have; the generation client resubmits prompt + partial output) or retract
            (they stay queued on the server, are re-prefilled under the new weights after the
            continue, and their replies carry `weight_versions` spans) or in_place (they keep their
            KV cache of the old weights and go on with the new ones; the update is sent with
            `flush_cache: false`, which SGLang needs for that); skipped when
            `interruptible: false` (SGLang then runs the update once in-flight requests finish);
            a method that needs its own mode (`WeightApplier.pause_mode`: LoRA adapters, abort)
            pauses in it whatever the config says;
  update    the applier of the message's method (`services/controller/weights/`): disk or
            broadcast; it stamps `weight_version` = the policy version;
  continue  `/continue_generation`.
A server that fails any phase is taken out of rotation and left paused (it must not serve
the old weights) and named in the result; it comes back once it holds the current version.
The caller serialises syncs (one lock) and owns the version number.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tandem.rollout.client import AdminClient
from tandem.services.config import ControllerConfig

from .registry import RegisteredServer, ServerRegistry
from .weights import SyncResult, SyncRun, WeightApplier, build_appliers

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, registry: ServerRegistry, admin_for: Callable[[RegisteredServer], AdminClient],
                 cfg: ControllerConfig):
        self.registry = registry
        self.admin_for = admin_for
        self.timeout_s = cfg.update_timeout_s
        # False: no pause; the update waits for in-flight requests to finish under the old
        # weights (SGLang's behaviour without a pause) -- the non-interruptible baseline.
        self.interruptible = cfg.interruptible
        self.interrupt_mode = cfg.interrupt_mode
        self.appliers: dict[str, WeightApplier] = build_appliers(cfg)

    def applier(self, msg) -> WeightApplier:
        """The applier of a weight message; ValueError naming the message if it is not one."""
        applier = self.appliers.get(getattr(msg, "OP", ""))
        if applier is None:
            raise ValueError(f"{type(msg).__name__} is not a weight message (known: {sorted(self.appliers)})")
        return applier

    def check(self, msg) -> None:
        self.applier(msg).check(msg)

    async def apply(self, msg) -> SyncResult:
        """Bring every healthy server to `msg.version` (unhealthy ones are failed, caught up later)."""
        applier = self.applier(msg)
        applier.check(msg)
        pause = self.interruptible or bool(applier.pause_mode)
        run = self._run(msg, applier, pause)
        targets = []
        for s in self.registry.servers.values():
            if s.healthy:
                targets.append(s)
            else:
                run.fail(s, f"unhealthy during the update to v{msg.version}; will be caught up")
        targets = await applier.receivers(run, targets, msg)
        return await self._sequence(run, applier, targets, msg, pause)

    async def catch_up(self, server: RegisteredServer, msg) -> SyncResult:
        """Bring one lagging server to `msg.version` (a replayable message: weights on disk).
        It is paused whatever `interruptible` says: it is out of rotation and must not serve
        while it loads."""
        applier = self.applier(msg)
        if not applier.replayable:
            raise ValueError(f"{msg.OP} cannot be replayed for one server")
        applier.check(msg)
        run = self._run(msg, applier, pause=True)
        return await self._sequence(run, applier, [server], msg, pause=True)

    def _mode(self, applier: WeightApplier) -> str:
        """The pause mode: the method's own where it needs one (adapters: abort), else the config's."""
        return applier.pause_mode or self.interrupt_mode

    def _run(self, msg, applier: WeightApplier, pause: bool) -> SyncRun:
        """The update flushes the KV cache unless the servers are paused `in_place`, whose running
        requests keep it (the server refuses the flush then). That follows the pause the sync
        really makes: a catch-up pauses even with `interruptible: false`, and a flush asked of a
        server paused in place with requests held would fail every catch-up of it, for good."""
        keep_kv = pause and self._mode(applier) == "in_place"
        return SyncRun(msg.version, self.admin_for, self.timeout_s, flush_cache=not keep_kv)

    async def _sequence(self, run: SyncRun, applier: WeightApplier, servers: list[RegisteredServer], msg,
                        pause: bool) -> SyncResult:
        t0 = time.perf_counter()
        timeout = self.timeout_s
        if pause:
            mode = self._mode(applier)
            servers = await run.phase("pause", servers, lambda a: a.pause_generation(mode, timeout))
        live = await applier.update(run, servers, msg) if servers else []
        for s in live:
            s.bring_back(msg.version)
        run.result.updated = [s.address for s in live]
        if pause:
            await run.phase("continue", live, lambda a: a.continue_generation(timeout))
        run.result.seconds = time.perf_counter() - t0
        return run.result
