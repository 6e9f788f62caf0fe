"""rollout/server/connection_guard.py over real TCP: idle connections cannot hold the embedded
server's descriptors. A small aiohttp app behind the same GuardedSite the server uses, a cap of
a few connections and a short first-request deadline, so each rule shows in a second."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from tandem.rollout.server.connection_guard import GuardedSite

CAP, FIRST_S = 4, 2.0


async def _serve():
    app = web.Application()
    async def ping(request):
        return web.Response(text="pong")
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = GuardedSite(runner, sock, CAP, FIRST_S)
    await site.start()
    return runner, site, sock.getsockname()[1]


def _closed(conn: socket.socket, wait_s: float) -> bool:
    """Whether the server closed `conn` within `wait_s` (EOF or reset, and no byte sent)."""
    conn.settimeout(wait_s)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_are_capped_and_closed_and_real_requests_go_on():
    async def main():
        runner, site, port = await _serve()
        loop = asyncio.get_running_loop()
        try:
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
            await asyncio.sleep(0.1)
            extra = socket.create_connection(("127.0.0.1", port))
            assert await loop.run_in_executor(None, _closed, extra, 5.0)        # over the cap: closed at once
            assert site.gate.refused >= 1
            # Each idle one is closed at its first-request deadline, freeing its place.
            assert all([await loop.run_in_executor(None, _closed, c, FIRST_S + 5.0) for c in idle])
            assert site.gate.timed_out == CAP
            async with aiohttp.ClientSession() as http:
                for _ in range(3):   # requests, and a kept-alive connection past the deadline
                    async with http.get(f"http://127.0.0.1:{port}/ping") as r:
                        assert r.status == 200 and await r.text() == "pong"
                    await asyncio.sleep(FIRST_S / 2)
            assert site.gate.timed_out == CAP   # a connection that sent a request is not cut
        finally:
            await runner.cleanup()
    asyncio.run(main())
