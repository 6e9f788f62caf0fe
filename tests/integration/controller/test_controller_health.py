"""Health checks and routing against SGLang 0.5.23's information routes.

In-process controller against `RecordingGenServer`s (see controller_helpers.py for why a
stand-in): liveness from `/model_info` (never a generation probe), the held version from its
live `weight_version` (not `/server_info`'s start-up value), load from `/v1/loads` summed over
data-parallel ranks, TP sizes from registration or `/server_info`. The stand-ins are real aiohttp
servers on real sockets; routing alone is in tests/unit/controller/test_controller_routing.py.
"""

from __future__ import annotations

import asyncio

import pytest
from sync_support import make_controller, register, servers, settle, shutdown

from tandem.services.protocol import WeightsOnDisk

pytestmark = pytest.mark.timeout(60)


def test_the_held_version_is_read_from_model_info_not_the_startup_server_info(exp):
    """After an update SGLang's /server_info still says the start-up version; a check reading it
    would take every updated server out of rotation and reload it at every poll."""
    async def main():
        (gen,) = await servers(1)
        c = make_controller(exp)
        try:
            await register(c, [gen])
            assert (await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))).ok
            assert gen.startup_version == "0" and gen.weight_version == "1"
            before = gen.paths()
            for _ in range(3):
                await c._check(c.registry.servers[gen.url])
            await settle(c)
            assert gen.paths() == before                 # no catch-up: it holds v1
            server = c.registry.servers[gen.url]
            assert server.servable and server.weight_version == 1
            # A server really behind is found from /model_info and caught up.
            gen.weight_version = "0"
            await c._check(server)
            await settle(c)
            assert gen.paths()[len(before):] == ["/pause_generation", "/update_weights_from_disk",
                                                 "/continue_generation"]
            assert gen.weight_version == "1" and server.servable
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_load_is_read_from_v1_loads_over_every_dp_rank(exp):
    async def main():
        (gen,) = await servers(1, load=(3, 4, 1, 2))     # dp rank 0: 3 running 4 waiting; rank 1: 1 + 2
        c = make_controller(exp)
        try:
            await register(c, [gen])
            server = c.registry.servers[gen.url]
            assert server.load == 10 and server.routed_since_poll == 0
            c.registry.pick()
            assert server.outstanding == 11
            gen.fail["/v1/loads"] = 500                   # load unknown: kept, the server stays healthy
            await c._check(server)
            assert server.load == 10 and server.healthy and server.failures == 0
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_liveness_never_runs_a_generation_probe(exp):
    """SGLang's /health generates a token (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is
    false) and stalls while generation is paused. The check must not depend on it: here /health
    would hang past the check's timeout, and the check neither calls it nor fails."""
    async def main():
        (gen,) = await servers(1)
        gen.delay["/health"] = 30.0
        c = make_controller(exp, http_timeout_s=1.0, health_failures=1)
        try:
            await register(c, [gen])
            server = c.registry.servers[gen.url]
            for _ in range(2):
                await c._check(server)
            assert server.healthy and server.failures == 0
            assert "/health" not in [p for p, _ in gen.calls] and "/generate" not in [p for p, _ in gen.calls]
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_a_failed_check_during_a_sync_is_not_counted_but_one_outside_is(exp):
    async def main():
        (gen,) = await servers(1)
        c = make_controller(exp, health_failures=2)
        try:
            await register(c, [gen])
            server = c.registry.servers[gen.url]
            gen.fail["/model_info"] = 503
            async with c.sync_lock:                        # a weight sync in progress
                for _ in range(3):
                    await c._check(server)
            assert server.healthy and server.failures == 0
            for _ in range(2):
                await c._check(server)
            assert not server.healthy and "failed 2 health checks" in server.reason
            with pytest.raises(LookupError, match="no generation server is in rotation"):
                c.registry.pick()
            del gen.fail["/model_info"]
            await c._check(server)
            assert server.servable
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_a_version_read_before_a_sync_is_not_judged_after_it(exp):
    """A check asks /model_info (v0), a sync to v1 runs while the check waits on its next call,
    then the check goes on: judging the old answer against the new version took the server just
    updated out of rotation and caught it up again (in a benchmark run with `interruptible: false`
    that catch-up paused it with requests running and the run hung). The answer is judged only
    against the version current, and no sync running, when it was asked."""
    async def main():
        (gen,) = await servers(1)
        c = make_controller(exp, interruptible=False)
        try:
            await register(c, [gen])
            server = c.registry.servers[gen.url]
            gen.gate["/v1/loads"] = asyncio.Event()          # hold the check after /model_info
            check = asyncio.ensure_future(c._check(server))
            while not any(path == "/v1/loads" for path, _ in gen.calls):
                await asyncio.sleep(0.01)
            assert (await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))).ok
            before = gen.paths()
            gen.gate["/v1/loads"].set()
            await check
            await settle(c)
            assert gen.paths()[len(before):] == []             # no pause, update, continue: no catch-up
            assert server.servable and server.weight_version == 1
            # The next check asks afresh and judges what it hears.
            gen.weight_version = "0"
            await c._check(server)
            await settle(c)
            assert gen.weight_version == "1" and server.servable
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_tp_size_comes_from_registration_or_server_info(exp):
    async def main():
        asked, told = await servers(2, tp_size=4)
        c = make_controller(exp)
        try:
            await register(c, [asked])                     # tp_size 0: asked from /server_info
            await register(c, [told], tp_sizes=[2])        # the launcher's word wins
            assert c.registry.servers[asked.url].tp_size == 4
            assert c.registry.servers[told.url].tp_size == 2
            assert "/server_info" not in [p for p, _ in told.calls]
            summary = {s["address"]: s["tp_size"] for s in c.registry.summary()}
            assert summary == {asked.url: 4, told.url: 2}
        finally:
            await shutdown(c, [asked, told])

    asyncio.run(main())
