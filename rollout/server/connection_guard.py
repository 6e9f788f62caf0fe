"""The embedded server's listening socket, guarded against connections that only hold descriptors.

aiohttp keeps a connection that never sends a request open for good, and accepts as many as
come: about 1,100 idle connections from anyone who can reach the port (another user of the
machine, on loopback) used up the server's 1,024 descriptors, after which its weight loads failed
and it left the rotation, while asyncio logged every failed accept (~100 MB in 45 s). So:
- at most `max_connections` at once (and never more than the descriptor limit leaves room for):
  one more is closed as soon as it is accepted, without a byte;
- a connection that has not sent a whole request within `first_request_s` is closed;
- refusals are logged once a minute with their count, never one line each.
A client the guard closed sees its connection end and retries, as after any network error;
the server's own work (weights, the model's files) always has descriptors left.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time

from aiohttp import web

log = logging.getLogger(__name__)

# Descriptors kept for the server's own files (a weight load opens every shard) and its clients.
RESERVED_FDS = 256
LOG_EVERY_S = 60.0


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to what the descriptor limit leaves after the reserve."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, min(wanted, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else wanted)


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()


class Gate:
    """A protocol factory in front of aiohttp's (`runner.server`): the cap and the first-request
    deadline above; `refused` and `timed_out` count what it closed."""

    def __init__(self, server, max_connections: int, first_request_s: float):
        self.server, self.cap, self.first_request_s = server, connection_cap(max_connections), first_request_s
        self.refused = self.timed_out = 0
        self._told, self._last_log = 0, time.monotonic()

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.cap:
            self.refused += 1
            self._log()
            return _Refused()
        handler = self.server()
        asyncio.get_running_loop().call_later(self.first_request_s, self._deadline, handler)
        return handler

    def _deadline(self, handler) -> None:
        # aiohttp counts a request once its head is parsed (web_protocol.RequestHandler).
        if handler.transport is not None and getattr(handler, "_request_count", 1) == 0:
            self.timed_out += 1
            handler.transport.close()
            self._log()

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S or not self._told:
            log.warning("closed %d connection(s) over the cap of %d and %d that sent no request within %.0f s "
                        "(so far)", self.refused, self.cap, self.timed_out, self.first_request_s)
            self._told, self._last_log = 1, now


class GuardedSite(web.SockSite):
    """aiohttp's SockSite, serving through a Gate."""

    def __init__(self, runner: web.BaseRunner, sock, max_connections: int, first_request_s: float):
        super().__init__(runner, sock)
        self.gate: Gate | None = None
        self._max, self._first = max_connections, first_request_s

    async def start(self) -> None:
        await web.BaseSite.start(self)
        self.gate = Gate(self._runner.server, self._max, self._first)
        self._server = await asyncio.get_running_loop().create_server(self.gate, sock=self._sock)
