"""Weights on disk: every server loads the trainer's Hugging Face directory itself.

`/update_weights_from_disk` needs no weight-update session in SGLang 0.5.23 (the session
check guards only distributed and tensor updates), and the directory stays on disk for the
trainer's `keep_weights` versions, so the same message also catches up a lagging server.
Servers with a weight relay (`gen.weight_relay`) get the version through their node's relay
first (weights/relay.py) and load that node-local copy; the others read the shared directory.
"""
from __future__ import annotations

from tandem.services.protocol import WeightsOnDisk

from ..registry import RegisteredServer
from .base import SyncRun, WeightApplier
from .relay import relay_version


class DiskApplier(WeightApplier):
    message = WeightsOnDisk
    replayable = True

    def check(self, msg: WeightsOnDisk) -> None:
        if msg.version < 0:
            raise ValueError(f"weights_on_disk: version must be >= 0, got {msg.version}")
        if not msg.path:
            raise ValueError("weights_on_disk: `path` (a Hugging Face directory) must not be empty")

    async def update(self, run: SyncRun, servers: list[RegisteredServer], msg: WeightsOnDisk) -> list[RegisteredServer]:
        relayed = [s for s in servers if s.relay]
        # {address: its node's copy}; the others (no relay, or their node's relay failed) read msg.path
        local = await relay_version(run, relayed, msg.path) if relayed else {}
        return await run.phase("update", servers, lambda a: a.update_weights_from_disk(
            local.get(a.url, msg.path), msg.version, flush_cache=run.flush_cache, timeout_s=run.timeout_s))
