"""With no generation server in rotation a rollout worker waits; it does not fail its groups
(issue 19, defect 5: each failed group consumed a prompt — 1,680 skipped in a 6 s outage — and
each turn was a "bad request" at the controller, 13,439 of them).

A real controller (in this process, serving on a real socket) and the worker's real routing
(`ControllerRouting` over a `RequestClient`); the generation server is the tests' stand-in HTTP
server, registered two seconds into the wait.
"""
from __future__ import annotations

import asyncio
import time

from sync_support import make_controller, register, servers, shutdown

from tandem.rollout.worker_cli import BACKOFF_MAX_S, ControllerRouting
from tandem.services.protocol import RequestClient, load_keys


def test_routing_waits_out_an_outage_and_asks_a_few_times_a_second_at_most(exp):
    async def main():
        c = make_controller(exp)
        c.server = c._bind()
        serving = asyncio.ensure_future(c.server.serve_forever())
        client = RequestClient(load_keys(exp.keys), c.server.address, timeout_s=10)
        routing = ControllerRouting(exp, client, "w")
        gens = await servers(1)
        try:
            t0 = time.monotonic()
            pick = asyncio.ensure_future(routing("group-1/0", frozenset()))
            await asyncio.sleep(2.0)
            assert not pick.done()                       # waiting, not failed
            asked, errors = c.requests, c.server.errors
            await register(c, gens)
            ref = await asyncio.wait_for(pick, timeout=BACKOFF_MAX_S + 5)
            waited = time.monotonic() - t0
            assert ref.url == gens[0].url and waited >= 2.0
            assert asked <= 2.0 / 0.1 and errors == 0   # backoff: ~7 asks in 2 s, none an error
        finally:
            client.close()
            c.server.close()
            serving.cancel()
            await shutdown(c, gens)

    asyncio.run(main())
