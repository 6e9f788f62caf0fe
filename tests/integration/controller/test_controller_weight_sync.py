"""Weight-sync orchestration, call by call: pause -> (the method's update) -> continue.

These tests drive the controller's handlers in-process against `RecordingGenServer`s: small
aiohttp servers in the test that keep SGLang 0.5.23's rules (auth levels, weight-update
sessions) and record every call, so the order of the phases, the bodies, the key used on each
route and the handling of injected failures can be checked exactly (a real server cannot be
told to fail on cue). The same orchestration against the real embedded server is in
test_controller_real_server.py; health checks and routing are in test_controller_health.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from controller_helpers import RecordingGenServer
from sync_support import ADMIN_KEY, KEY, make_controller, register, servers, settle, shutdown

from tandem.rollout.client import AdminClient, AdminError
from tandem.services.protocol import PickServer, StatusRequest, WeightsBroadcast, WeightsOnDisk, read_metrics

pytestmark = pytest.mark.timeout(60)
SESSION = ["/begin_weight_update", "/init_weights_update_group", "/update_weights_from_distributed",
           "/destroy_weights_update_group", "/end_weight_update"]


def broadcast(version: int, world_size: int) -> WeightsBroadcast:
    return WeightsBroadcast(version=version, group_name=f"tandem-weights-v{version}", master_address="127.0.0.1",
                            master_port=29555, world_size=world_size, names=["a", "b"],
                            dtypes=["float32", "bfloat16"], shapes=[[4], [2, 2]])


def test_admin_client_sends_sglang_bodies_with_the_admin_key_on_admin_routes():
    """Bodies are what SGLang's io_struct classes accept; ADMIN_OPTIONAL routes carry the admin
    key, NORMAL routes (/model_info, /server_info, /v1/loads) the API key (utils/auth.py)."""
    async def main():
        gen = RecordingGenServer(api_key=KEY, admin_key=ADMIN_KEY)
        await gen.start()
        admin = AdminClient(gen.url, KEY, timeout_s=5, admin_key=ADMIN_KEY)
        try:
            await admin.pause_generation("retract")
            await admin.update_weights_from_disk("/w/v3", 3)
            await admin.begin_weight_update()
            await admin.init_weights_update_group("10.0.0.1", 29500, 3, 5, "g3", "gloo")
            await admin.update_weights_from_distributed(["a.w"], ["float32"], [[2, 3]], "g3", 3)
            await admin.destroy_weights_update_group("g3")
            await admin.end_weight_update()
            await admin.continue_generation()
            await admin.flush_cache()
            await admin.abort_request(abort_all=True)
            assert (await admin.model_info())["weight_version"] == "3"
            assert (await admin.server_info())["tp_size"] == 1
            assert (await admin.loads())["loads"][0]["dp_rank"] == 0
            assert gen.calls == [
                ("/pause_generation", {"mode": "retract"}),
                ("/update_weights_from_disk", {"model_path": "/w/v3", "weight_version": "3"}),
                ("/begin_weight_update", {}),
                ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                                "rank_offset": 3, "world_size": 5, "group_name": "g3",
                                                "backend": "gloo"}),
                ("/update_weights_from_distributed", {"names": ["a.w"], "dtypes": ["float32"],
                                                      "shapes": [[2, 3]], "group_name": "g3",
                                                      "weight_version": "3"}),
                ("/destroy_weights_update_group", {"group_name": "g3"}),
                ("/end_weight_update", {}),
                ("/continue_generation", {}),
                ("/flush_cache", {}),
                ("/abort_request", {"abort_all": True}),
                ("/model_info", {}), ("/server_info", {}), ("/v1/loads", {}),
            ]
            normal = {"/model_info", "/server_info", "/v1/loads"}
            assert all(key == (KEY if path in normal else ADMIN_KEY) for path, key in gen.keys)
            # SGLang with --admin-api-key refuses the API key on admin routes.
            with pytest.raises(AdminError, match="unauthorized: wrong or missing API key") as info:
                await AdminClient(gen.url, KEY, session=admin._http()).pause_generation()
            assert info.value.status == 401
            gen.fail["/update_weights_from_disk"] = 400
            with pytest.raises(AdminError, match="injected failure") as info:
                await admin.update_weights_from_disk("/w/v4", 4)
            assert info.value.status == 400
            with pytest.raises(ValueError, match="mode"):
                await admin.pause_generation("later")
        finally:
            await admin.close()
            await gen.stop()
        dead = AdminClient(gen.url, KEY, timeout_s=2)
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
            ack = await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))
            assert ack.ok and ack.version == 1 and ack.failed_servers == []
            assert {"pause_s", "update_s", "continue_s", "total_s"} <= set(ack.timings)
            for g in gens:
                assert g.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
                # the default interrupt_mode in_place keeps the running KV cache: no flush
                assert ("/pause_generation", {"mode": "in_place"}) in g.calls
                assert ("/update_weights_from_disk", {"model_path": "/w/v1", "weight_version": "1",
                                                      "flush_cache": False}) in g.calls
                assert not g.paused
            state = c.status(StatusRequest()).state
            assert state["version"] == 1 and all(s["in_rotation"] and s["weight_version"] == 1
                                                 for s in state["servers"])
        finally:
            await shutdown(c, gens)
        sync = [r for r in read_metrics(exp, "controller") if r.get("event") == "weight_sync"]
        assert sync[-1]["version"] == 1 and sync[-1]["method"] == "weights_on_disk"
        assert {"pause", "update", "continue"} <= set(sync[-1]["phases"])

    asyncio.run(main())


def test_interrupt_modes_retract_pauses_in_retract_and_non_interruptible_never_pauses(exp):
    """`interrupt_mode: retract`: requests stay on the server across the update (nothing is
    resubmitted). `interruptible: false`: the update alone, which the server runs after its
    in-flight requests finish (the non-interruptible baseline)."""
    async def main():
        (gen,) = await servers(1)
        c = make_controller(exp, interrupt_mode="retract")
        try:
            await register(c, [gen])
            assert (await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))).ok
            assert gen.calls[gen.calls.index(("/pause_generation", {"mode": "retract"})) + 1][0] == \
                "/update_weights_from_disk"
            c.syncer.interruptible = False
            before = len(gen.paths())
            assert (await c.weights_published(WeightsOnDisk(version=2, path="/w/v2"))).ok
            assert gen.paths()[before:] == ["/update_weights_from_disk"]
        finally:
            await shutdown(c, [gen])
        from tandem.services.config import ControllerConfig
        assert dict(ControllerConfig(groups_per_step=1, interrupt_mode="paused").problems())["interrupt_mode"] \
            == "must be 'abort', 'retract' or 'in_place', got 'paused'"

    asyncio.run(main())


def test_a_failing_server_leaves_rotation_paused_and_is_caught_up_later(exp):
    async def main():
        good, bad = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, [good, bad])
            bad.fail["/update_weights_from_disk"] = 400
            ack = await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))
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
            await settle(c)
            assert bad.weight_version == "1" and not bad.paused
            assert c.registry.servers[bad.url].servable
            # Back in rotation, and the least loaded (the other one has 20 requests outstanding).
            assert {c.pick_server(PickServer("w", f"j{i}")).address for i in range(20)} == {bad.url}
        finally:
            await shutdown(c, [good, bad])

    asyncio.run(main())


def test_updates_are_serialised_and_never_go_backwards(exp):
    async def main():
        (gen,) = await servers(1)
        gen.delay["/update_weights_from_disk"] = 0.2
        c = make_controller(exp)
        try:
            await register(c, [gen])
            acks = await asyncio.gather(c.weights_published(WeightsOnDisk(version=1, path="/w/v1")),
                                        c.weights_published(WeightsOnDisk(version=2, path="/w/v2")))
            assert [a.version for a in acks] == [1, 2] and all(a.ok for a in acks)
            calls = [(p, b.get("weight_version")) for p, b in gen.calls if p in gen.paths()]
            assert calls == [("/pause_generation", None), ("/update_weights_from_disk", "1"),
                             ("/continue_generation", None), ("/pause_generation", None),
                             ("/update_weights_from_disk", "2"), ("/continue_generation", None)]
            with pytest.raises(ValueError, match="never go backwards"):
                await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))
            with pytest.raises(ValueError, match="is not a weight message"):
                await c.weights_published(StatusRequest())
            assert c.ledger.version == 2
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_broadcast_runs_in_a_session_with_rank_offsets_by_tp_size(exp):
    """TP 2 + TP 1 = 3 receiving ranks, world 4: offsets 1 and 3 (SGLang joins rank_offset +
    tp_rank). A third server does not fit this group and rejoins at the next update."""
    async def main():
        gens = await servers(3)
        c = make_controller(exp)
        try:
            await register(c, gens, tp_sizes=[2, 1, 1])
            ack = await c.weights_published(broadcast(1, world_size=4))
            assert ack.failed_servers == [gens[2].url] and not gens[2].paused and gens[2].paths() == []
            for offset, g in zip((1, 3), gens[:2], strict=True):
                assert g.paths() == ["/pause_generation", *SESSION, "/continue_generation"]
                init = dict(g.calls)["/init_weights_update_group"]
                assert init == {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": offset,
                                "world_size": 4, "group_name": "tandem-weights-v1", "backend": "gloo"}
                upd = dict(g.calls)["/update_weights_from_distributed"]
                assert upd["names"] == ["a", "b"] and upd["shapes"] == [[4], [2, 2]] and upd["weight_version"] == "1"
                assert not g.session and c.registry.servers[g.url].weight_version == 1
            assert {"begin_s", "init_group_s", "update_s", "end_s"} <= set(ack.timings)
        finally:
            await shutdown(c, gens)

    asyncio.run(main())


def test_a_broadcast_asks_a_server_its_tp_size_when_nobody_said_it_yet(exp):
    """Registered with tp_size 0 and not health-checked yet (a broadcast right after
    registration): the broadcast asks /server_info before assigning ranks."""
    async def main():
        (gen,) = await servers(1, tp_size=2)
        c = make_controller(exp)
        try:
            await register(c, [gen])
            c.registry.servers[gen.url].tp_size = 0
            gen.calls.clear()
            ack = await c.weights_published(broadcast(1, world_size=3))
            assert ack.ok and [p for p, _ in gen.calls][:2] == ["/server_info", "/pause_generation"]
            assert dict(gen.calls)["/init_weights_update_group"]["rank_offset"] == 1
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_a_failed_broadcast_still_ends_every_session_it_opened(exp):
    """One receiver failing to join fails the collective for all (no half update), and
    /end_weight_update is still called wherever /begin_weight_update succeeded."""
    async def main():
        gens = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, gens, tp_sizes=[1, 1])
            gens[1].fail["/init_weights_update_group"] = 400
            ack = await c.weights_published(broadcast(1, world_size=3))
            assert not ack.ok and set(ack.failed_servers) == {g.url for g in gens}
            for g in gens:
                assert g.paths() == ["/pause_generation", "/begin_weight_update", "/init_weights_update_group",
                                     "/end_weight_update"]
                assert not g.session and g.paused       # session closed, left paused out of rotation
            assert "init_group failed" in c.registry.servers[gens[1].url].reason
            assert "could not join" in c.registry.servers[gens[0].url].reason
            # The update itself failing: the session is closed too.
            del gens[1].fail["/init_weights_update_group"]
            for g in gens:
                g.calls.clear()
                c.registry.servers[g.url].bring_back(1)
            gens[0].fail["/update_weights_from_distributed"] = 400
            ack = await c.weights_published(broadcast(2, world_size=3))
            assert ack.failed_servers == [gens[0].url]
            assert gens[0].paths() == ["/pause_generation", *SESSION]     # never continued
            assert not gens[0].session and not gens[1].session
            assert gens[1].paths()[-1] == "/continue_generation"
            # A session refused on one server: the one opened elsewhere is closed, nothing is sent.
            del gens[0].fail["/update_weights_from_distributed"]
            for g in gens:
                g.calls.clear()
                c.registry.servers[g.url].bring_back(2)
            gens[1].fail["/begin_weight_update"] = 400
            ack = await c.weights_published(broadcast(3, world_size=3))
            assert set(ack.failed_servers) == {g.url for g in gens}
            assert gens[0].paths() == ["/pause_generation", "/begin_weight_update", "/end_weight_update"]
            assert gens[1].paths() == ["/pause_generation", "/begin_weight_update"] and not gens[0].session
        finally:
            await shutdown(c, gens)

    asyncio.run(main())


def test_a_server_registered_after_an_update_is_brought_to_the_current_version(exp):
    async def main():
        first, late = await servers(2)
        c = make_controller(exp)
        try:
            await register(c, [first])
            await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))
            await register(c, [late])          # starts with the initial weights, "0"
            assert late.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
            assert late.weight_version == "1" and c.registry.servers[late.url].servable
        finally:
            await shutdown(c, [first, late])

    asyncio.run(main())


def test_a_restarted_controller_resumes_servers_its_predecessor_left_paused(exp):
    """Killed between pause and continue, the old controller left the server paused at the
    current version; the new one restores the registry and tells it to continue."""
    async def main():
        (gen,) = await servers(1)
        old = make_controller(exp)
        try:
            await register(old, [gen])
            await old.weights_published(WeightsOnDisk(version=1, path="/w/v1"))
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


def test_a_snapshot_from_before_admin_keys_and_weight_messages_still_loads(exp):
    """An older state.json: registry entries without admin_key_ref/tp_size, last_weights with
    `how`/`path`. It loads, and a lagging server is still caught up from that directory."""
    async def main():
        (gen,) = await servers(1)
        state_dir = exp.checkpoints / "controller"
        state_dir.mkdir(parents=True)
        old_ledger = {"epoch": 0, "version": 3, "accepted": 8, "rejected": 0, "failed": 0, "admitted": 8,
                      "late_accepts": 0, "next_seq": 8, "running": {}, "finished": []}
        (state_dir / "state.json").write_text(json.dumps({
            "ledger": old_ledger, "journal_seq": 0,
            "registry": [{"address": gen.url, "api_key_ref": "gen-api-key", "capacity": 64, "healthy": True,
                          "in_rotation": True, "reason": "", "routed_total": 0, "weight_version": 3, "extra": {}}],
            "last_weights": {"version": 3, "how": "disk", "path": "/w/v3"}}))
        c = make_controller(exp)
        try:
            server = c.registry.servers[gen.url]
            assert (server.admin_key_ref, server.tp_size) == ("", 0)
            assert c.last_weights == {"version": 3, "method": "weights_on_disk",
                                      "message": {"version": 3, "path": "/w/v3"}}
            await c._check(server)            # holds "0": caught up to v3 from /w/v3
            await settle(c)
            assert ("/update_weights_from_disk", {"model_path": "/w/v3", "weight_version": "3",
                                                  "flush_cache": False}) in gen.calls
            assert server.servable and server.tp_size == 1     # learned from /server_info
        finally:
            await shutdown(c, [gen])

    asyncio.run(main())


def test_a_resume_forgets_the_earlier_launch_and_its_abandoned_weights(exp):
    """--resume: the earlier launch's servers are gone (forgotten at LaunchStarted, not polled
    and updated for ever), and weights it published past the trainer's checkpoint are no longer
    what a new server is caught up to; the trainer's republished version then is (issue 19)."""
    from tandem.services.protocol import LaunchStarted, TrainerResumed

    async def main():
        (old_gen,) = await servers(1)
        first = make_controller(exp)
        try:
            await register(first, [old_gen])
            for v in (1, 2, 3):
                await first.weights_published(WeightsOnDisk(version=v, path=f"/w/v{v}"))
            first.store.close()
            await first._http.close()
        finally:
            await old_gen.stop()
        (new_gen,) = await servers(1)
        c = make_controller(exp)                       # the resumed launch's controller
        try:
            assert old_gen.url in c.registry.servers
            c.launch_started(LaunchStarted(launch_id="l2"))
            assert c.registry.servers == {}
            await c.trainer_resumed(TrainerResumed(version=1, groups_held=2))   # checkpoint at v1
            assert c.last_weights == {"version": 1, "method": "resumed", "message": None}
            await register(c, [new_gen])
            await c.weights_published(WeightsOnDisk(version=1, path="/w/v1"))  # the trainer's republish
            assert list(c.registry.servers) == [new_gen.url] and c.registry.servers[new_gen.url].servable
            loads = [b["model_path"] for p, b in new_gen.calls if p == "/update_weights_from_disk"]
            assert "/w/v3" not in loads and loads[-1] == "/w/v1"
            assert make_controller(exp).registry.servers.keys() == {new_gen.url}   # and it is persisted
        finally:
            await shutdown(c, [new_gen])

    asyncio.run(main())
