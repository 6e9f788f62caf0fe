"""Retiring a generation server: the controller's part of the elastic split and of `tandem scale`.

The launcher's elastic split (launcher/elastic.py) gives a generation server's CPUs (GPUs on a
cluster) to training during a run; `tandem scale --remove` (launcher/scaling.py) gives a node
back to the cluster. Before the launcher stops the server, the controller must
let go of it without losing a request:
  1. out of rotation at once: nothing new is routed there (sticky keys move to other servers);
  2. under the sync lock: a weight update in progress would resume the server and bring it back
     into rotation (`weight_sync._sequence`), so the retirement waits for it (`timeout_s`) and
     takes the server out again;
  3. paused in abort mode: its in-flight requests come back to their clients with the tokens
     they have; the generation client asks the controller again after an abort and is routed to
     another server (rollout/client/generate.py), so each sample goes on there, every token
     keeping the version that sampled it;
  4. forgotten (and the registry snapshotted), so health checks and catch-ups leave it alone.
Requests already on their way to it when it left the rotation wait there, paused, until the
launcher stops the process; they then fail over to another server like any request whose
server died. Nothing is lost either way; the audit of the run shows it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from tandem.rollout.client import AdminClient
from tandem.services.config import ControllerConfig
from tandem.services.protocol import MetricsWriter, Ok, RetireServer

from .registry import RegisteredServer, ServerRegistry

log = logging.getLogger(__name__)


class Controller(Protocol):
    """The parts of the controller (server.py) a retirement uses."""
    cfg: ControllerConfig
    registry: ServerRegistry
    sync_lock: asyncio.Lock
    metrics: MetricsWriter | None
    _retiring: set[str]      # addresses being retired: health checks and catch-ups skip them

    def _admin(self, server: RegisteredServer) -> AdminClient: ...

    def snapshot(self) -> None: ...

REASON = "retiring: leaves the run (elastic split or tandem scale)"


async def retire(ctl: Controller, req: RetireServer) -> Ok:
    """Steps 1-4 above; ValueError (an error reply naming the problem) for an unknown address,
    the last server, a server already being retired, or an update that outlasts `timeout_s` (the
    server then stays in the run as it was)."""
    address = req.address.rstrip("/")
    servers = ctl.registry.servers
    server = servers.get(address)
    if server is None:
        raise ValueError(f"retire_server: {address!r} is not a registered generation server "
                         f"(registered: {', '.join(servers) or 'none'})")
    if address in ctl._retiring:
        raise ValueError(f"retire_server: {address} is already being retired")
    if len(servers) == 1:
        raise ValueError(f"retire_server: {address} is the only generation server; retiring it would stop generation")
    if not req.timeout_s > 0:
        raise ValueError(f"retire_server: timeout_s must be > 0, got {req.timeout_s}")
    t0 = time.monotonic()
    was = (server.in_rotation, server.reason)
    ctl._retiring.add(address)
    server.take_out(REASON)
    try:
        try:
            await asyncio.wait_for(ctl.sync_lock.acquire(), req.timeout_s)
        except TimeoutError:
            server.in_rotation, server.reason = was
            raise ValueError(f"retire_server: a weight update held the servers for over {req.timeout_s:.0f}s; "
                             f"{address} stays in the run") from None
        try:
            server.take_out(REASON)   # an update that ran meanwhile brought it back
            try:
                await ctl._admin(server).pause_generation("abort", min(req.timeout_s, ctl.cfg.http_timeout_s))
                paused = "paused (abort): its in-flight requests went back to their clients"
            except Exception as e:   # unreachable: its requests fail over once it stops
                paused = f"could not pause it ({type(e).__name__}: {e}); its requests fail over when it stops"
            ctl.registry.forget(address)
            ctl.snapshot()
        finally:
            ctl.sync_lock.release()
    finally:
        ctl._retiring.discard(address)
    seconds = time.monotonic() - t0
    log.warning("retired generation server %s in %.2fs: %s", address, seconds, paused)
    if ctl.metrics:
        ctl.metrics.log(event="server_retired", server=address, seconds=seconds, detail=paused,
                        servers_left=len(servers))
    return Ok(detail=f"retired {address}: {paused}")
