"""Weight-sync orchestration and routing, call by call.

These tests drive the controller's handlers in-process against `RecordingGenServer`s: small
aiohttp servers in the test that answer in SGLang 0.5.x's shapes and record every call, so the
order of the phases, the bodies, the bearer key and the handling of injected failures can be
checked exactly (a real server cannot be told to fail on cue). The same orchestration against
the real embedded server is in test_controller_real_server.py.
"""
from __future__ import annotations

import asyncio

import pytest
from controller_helpers import RecordingGenServer

from rollout.client import AdminClient, AdminError
from services.config import ControllerConfig
from services.controller.registry import ServerRegistry
from services.controller.server import Controller
from services.protocol import (
    MetricsWriter,
    PickServer,
    RegisterServer,
    StatusRequest,
    WeightsReady,
    read_metrics,
)

pytestmark = pytest.mark.timeout(60)
KEY = "secret-key-for-tests"


def make_controller(exp, **kw) -> Controller:
    (exp.keys / "gen-api-key").write_text(KEY + "\n")
    cfg = ControllerConfig(**{"groups_per_step": 2, "max_staleness": 0, "health_interval_s": 3600,
                              "http_timeout_s": 5.0, "update_timeout_s": 10.0, "broadcast_backend": "gloo", **kw})
    c = Controller(cfg, exp)
    c.restore()
    c.metrics = MetricsWriter(exp, "controller")
    return c


async def servers(n: int, **kw) -> list[RecordingGenServer]:
    out = [RecordingGenServer(api_key=KEY, **kw) for _ in range(n)]
    for s in out:
        await s.start()
    return out


async def register(c: Controller, gens: list[RecordingGenServer]) -> None:
    for g in gens:
        c.register_server(RegisterServer(address=g.url, api_key_ref="gen-api-key"))
    while c._tasks:     # the health check, and the catch-up it may start
        await asyncio.gather(*list(c._tasks))


def test_admin_client_sends_sglang_shapes_and_names_failures():
    async def main():
        (gen,) = await servers(1)
        admin = AdminClient(gen.url, KEY, timeout_s=5)
        try:
            await admin.pause_generation()
            await admin.update_weights_from_disk("/w/v3", 3)
            await admin.init_weights_update_group("10.0.0.1", 29500, 1, 3, "g3", "gloo")
            await admin.update_weights_from_distributed(["a.w"], ["float32"], [[2, 3]], "g3", 3)
            await admin.destroy_weights_update_group("g3")
            await admin.continue_generation()
            await admin.flush_cache()
            assert await admin.health()
            assert (await admin.get_model_info())["weight_version"] == "3"
            assert gen.calls == [
                ("/pause_generation", {"mode": "abort"}),
                ("/update_weights_from_disk", {"model_path": "/w/v3", "weight_version": "3"}),
                ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                                "rank_offset": 1, "world_size": 3, "group_name": "g3",
                                                "backend": "gloo"}),
                ("/update_weights_from_distributed", {"names": ["a.w"], "dtypes": ["float32"],
                                                      "shapes": [[2, 3]], "group_name": "g3",
                                                      "weight_version": "3"}),
                ("/destroy_weights_update_group", {"group_name": "g3"}),
                ("/continue_generation", {}),
                ("/flush_cache", {}),
                ("/health", {}),
                ("/get_model_info", {}),
            ]
            gen.fail["/update_weights_from_disk"] = 400
            with pytest.raises(AdminError, match="injected failure") as info:
                await admin.update_weights_from_disk("/w/v4", 4)
            assert info.value.status == 400
            with pytest.raises(AdminError, match="unauthorized"):
                await AdminClient(gen.url, "wrong", session=admin._http()).pause_generation()
            with pytest.raises(ValueError, match="mode"):
                await admin.pause_generation("later")
        finally:
            await admin.close()
            await gen.stop()
        dead = AdminClient(gen.url, KEY, timeout_s=2)
        assert not await dead.health()
        with pytest.raises(AdminError, match=gen.url.split("//")[1]):
            await dead.continue_generation()
        await dead.close()

    asyncio.run(main())


def test_disk_update_pauses_updates_and_continues_every_server(exp):
    async def main():
        gens = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, gens)
            ack = await c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            assert ack.ok and ack.version == 1 and ack.failed_servers == []
            assert {"pause_s", "update_s", "continue_s", "total_s"} <= set(ack.timings)
            for g in gens:
                assert g.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
                assert ("/update_weights_from_disk", {"model_path": "/w/v1", "weight_version": "1"}) in g.calls
                assert not g.paused
            state = c.status(StatusRequest()).state
            assert state["version"] == 1 and all(s["in_rotation"] and s["weight_version"] == 1
                                                 for s in state["servers"])
        finally:
            for g in gens:
                await g.stop()
            await c._http.close()
        sync = [r for r in read_metrics(exp, "controller") if r.get("event") == "weight_sync"]
        assert sync[-1]["version"] == 1 and {"pause", "update", "continue"} <= set(sync[-1]["phases"])

    asyncio.run(main())


def test_non_interruptible_update_neither_pauses_nor_continues(exp):
    """`controller.interruptible: false` (the baseline the async benchmark compares against):
    the update alone, which the server runs after its in-flight requests finish."""
    async def main():
        gens = await servers(1)
        c = make_controller(exp, interruptible=False)
        try:
            await register(c, gens)
            ack = await c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            assert ack.ok and gens[0].paths() == ["/update_weights_from_disk"]
        finally:
            await gens[0].stop()
            await c._http.close()

    asyncio.run(main())


def test_a_failing_server_leaves_rotation_paused_and_is_caught_up_later(exp):
    async def main():
        good, bad = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, [good, bad])
            bad.fail["/update_weights_from_disk"] = 400
            ack = await c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            assert not ack.ok and ack.failed_servers == [bad.url] and c.ledger.version == 1
            assert bad.paths() == ["/pause_generation", "/update_weights_from_disk"]   # never continued
            assert bad.paused
            picks = {c.pick_server(PickServer("w", f"k{i}")).address for i in range(20)}
            assert picks == {good.url}
            reason = next(s for s in c.status(StatusRequest()).state["servers"] if s["address"] == bad.url)
            assert not reason["in_rotation"] and "update failed for v1" in reason["reason"]
            # Repaired: the next health check finds it behind and brings it to v1 from disk.
            del bad.fail["/update_weights_from_disk"]
            await c._check(c.registry.servers[bad.url])
            while c._tasks:
                await asyncio.gather(*list(c._tasks))
            assert bad.weight_version == "1" and not bad.paused
            assert c.registry.servers[bad.url].servable
            # Back in rotation, and the least loaded (the other one has 20 requests outstanding).
            assert {c.pick_server(PickServer("w", f"j{i}")).address for i in range(20)} == {bad.url}
        finally:
            for g in (good, bad):
                await g.stop()
            await c._http.close()

    asyncio.run(main())


def test_updates_are_serialised_and_never_go_backwards(exp):
    async def main():
        (gen,) = await servers(1)
        gen.delay["/update_weights_from_disk"] = 0.2
        c = make_controller(exp)
        try:
            await register(c, [gen])
            acks = await asyncio.gather(c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1")),
                                        c.weights_ready(WeightsReady(version=2, how="disk", path="/w/v2")))
            assert [a.version for a in acks] == [1, 2] and all(a.ok for a in acks)
            calls = [(p, b.get("weight_version")) for p, b in gen.calls if p not in ("/health", "/get_server_info")]
            assert calls == [("/pause_generation", None), ("/update_weights_from_disk", "1"),
                             ("/continue_generation", None), ("/pause_generation", None),
                             ("/update_weights_from_disk", "2"), ("/continue_generation", None)]
            with pytest.raises(ValueError, match="never go backwards"):
                await c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            assert c.ledger.version == 2
        finally:
            await gen.stop()
            await c._http.close()

    asyncio.run(main())


def test_broadcast_joins_every_server_with_its_rank_then_updates(exp):
    async def main():
        gens = await servers(3)
        c = make_controller(exp)
        ready = WeightsReady(version=1, how="broadcast", group_name="tandem-weights-v1", master_address="127.0.0.1",
                             master_port=29555, world_size=3, names=["a", "b"], dtypes=["float32", "bfloat16"],
                             shapes=[[4], [2, 2]])
        try:
            await register(c, gens)
            ack = await c.weights_ready(ready)
            # world_size 3 = trainer + 2 receivers: the third server cannot take part this time.
            assert ack.failed_servers == [gens[2].url] and not gens[2].paused and gens[2].paths() == []
            for rank, g in enumerate(gens[:2], start=1):
                assert g.paths() == ["/pause_generation", "/init_weights_update_group",
                                     "/update_weights_from_distributed", "/destroy_weights_update_group",
                                     "/continue_generation"]
                init = dict(g.calls)["/init_weights_update_group"]
                assert init == {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": rank,
                                "world_size": 3, "group_name": "tandem-weights-v1", "backend": "gloo"}
                upd = dict(g.calls)["/update_weights_from_distributed"]
                assert upd["names"] == ["a", "b"] and upd["shapes"] == [[4], [2, 2]] and upd["weight_version"] == "1"
            # One receiver failing to join fails the whole broadcast for everyone (no half update).
            gens[1].fail["/init_weights_update_group"] = 400
            ready2 = WeightsReady(**{**ready.__dict__, "version": 2, "group_name": "tandem-weights-v2"})
            ack = await c.weights_ready(ready2)
            assert not ack.ok and set(ack.failed_servers) >= {gens[0].url, gens[1].url}
            assert "/update_weights_from_distributed" not in [p for p, b in gens[0].calls
                                                             if b.get("group_name") == "tandem-weights-v2"]
        finally:
            for g in gens:
                await g.stop()
            await c._http.close()

    asyncio.run(main())


def test_a_server_registered_after_an_update_is_brought_to_the_current_version(exp):
    async def main():
        first, late = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, [first])
            await c.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            await register(c, [late])          # starts with the initial weights, "0"
            assert late.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
            assert late.weight_version == "1" and c.registry.servers[late.url].servable
        finally:
            for g in (first, late):
                await g.stop()
            await c._http.close()

    asyncio.run(main())


def test_routing_is_least_outstanding_and_sticky():
    reg = ServerRegistry(sticky_entries=3)
    a, _ = reg.register("http://a:1", capacity=2)
    b, _ = reg.register("http://b:1", capacity=4)
    counts = {"http://a:1": 0, "http://b:1": 0}
    for _ in range(6):
        counts[reg.pick().address] += 1
    assert counts == {"http://a:1": 2, "http://b:1": 4}          # proportional to capacity
    first = reg.pick("sample-1").address
    assert all(reg.pick("sample-1").address == first for _ in range(5))
    other = "http://b:1" if first == "http://a:1" else "http://a:1"
    assert reg.pick("sample-1", exclude=[first]).address == other   # failover moves the key
    reg.servers[other].take_out("failed an update")
    assert {reg.pick(f"k{i}").address for i in range(5)} == {first}
    a.healthy = b.healthy = False
    with pytest.raises(LookupError, match="no generation server is in rotation"):
        reg.pick()
    assert len(reg.sticky) <= 3


def test_a_restarted_controller_resumes_servers_its_predecessor_left_paused(exp):
    """Killed between pause and continue, the old controller left the server paused at the
    current version; the new one restores the registry and tells it to continue."""
    async def main():
        (gen,) = await servers(1)
        old = make_controller(exp)
        try:
            await register(old, [gen])
            await old.weights_ready(WeightsReady(version=1, how="disk", path="/w/v1"))
            old.store.close()
            await old._http.close()
            gen.paused = True                              # as if the kill came before continue
            new = make_controller(exp)
            assert new.ledger.version == 1 and gen.url in new.registry.servers
            await new._check(new.registry.servers[gen.url], after_restart=True)
            assert not gen.paused and gen.paths()[-1] == "/continue_generation"
            assert new.registry.servers[gen.url].servable
            await new._http.close()
        finally:
            await gen.stop()

    asyncio.run(main())
