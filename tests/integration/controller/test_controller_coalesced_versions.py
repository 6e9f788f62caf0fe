"""Coalesced weight versions (services/controller/pending_versions.py): while an update holds the
sync lock (with `interruptible: false`, a server draining its running requests), a newer disk
announcement supersedes an older one still waiting, which is answered at once with
`superseded_by`; the servers go straight to the newest. A broadcast, once announced, is applied.

In-process against `RecordingGenServer`s (real HTTP), whose update is held by a gate the test
opens: the drain, on cue. The real controller process with a real draining embedded server is
in test_controller_real_server.py.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from sync_support import make_controller, register, servers, shutdown

from tandem.services.protocol import StatusRequest, WeightsBroadcast, WeightsOnDisk, read_metrics

pytestmark = pytest.mark.timeout(60)
DISK = "/update_weights_from_disk"


def disk(version: int) -> WeightsOnDisk:
    return WeightsOnDisk(version=version, path=f"/w/v{version}")


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def loaded(gen) -> list[str]:
    """The versions the server was told to load, in order."""
    return [body.get("weight_version") for path, body in gen.calls
            if path in (DISK, "/update_weights_from_distributed")]


@contextlib.asynccontextmanager
async def v1_draining(exp, n: int, **controller):
    """`n` servers whose disk updates wait for the `drain` event, registered with a
    non-interruptible controller, and v1 announced and loading on all of them (draining):
    (servers, controller, drain, v1's pending ack). Shut down on leaving."""
    gens = await servers(n)
    c = make_controller(exp, interruptible=False, **controller)
    drain = asyncio.Event()
    for g in gens:
        g.gate[DISK] = drain
    try:
        await register(c, gens)
        first = asyncio.ensure_future(c.weights_published(disk(1)))
        await until(lambda: all(loaded(g) == ["1"] for g in gens))
        yield gens, c, drain, first
    finally:
        await shutdown(c, gens)


def test_a_waiting_version_is_superseded_and_the_servers_jump_to_the_newest(exp):
    async def main():
        async with v1_draining(exp, 2, groups_per_step=2, max_staleness=1) as (gens, c, drain, first):
            second = asyncio.ensure_future(c.weights_published(disk(2)))
            await until(lambda: c.pending.newest_waiting() == 2)
            third = asyncio.ensure_future(c.weights_published(disk(3)))
            ack2 = await second       # answered while v1 still drains: nothing waits for it
            assert ack2.superseded_by == 3 and ack2.ok and ack2.version == 2 and ack2.failed_servers == []
            assert not first.done() and c.ledger.version == 0
            drain.set()
            ack1, ack3 = await first, await third
            assert (ack1.version, ack1.superseded_by, ack3.version, ack3.superseded_by) == (1, 0, 3, 0)
            assert ack1.ok and ack3.ok
            for g in gens:   # no pause (non-interruptible), and v2 never loaded
                assert loaded(g) == ["1", "3"] and "/pause_generation" not in g.paths()
            assert c.ledger.version == 3 and c.last_weights["version"] == 3
            state = c.status(StatusRequest()).state
            assert state["version"] == 3 and all(s["weight_version"] == 3 for s in state["servers"])
        events = read_metrics(exp, "controller")
        assert [(e["version"], e["superseded_by"]) for e in events if e.get("event") == "weights_superseded"] \
            == [(2, 3)]
        assert [e["version"] for e in events if e.get("event") == "weight_sync"] == [1, 3]

    asyncio.run(main())


def test_only_the_newest_of_several_waiting_versions_is_applied(exp):
    """v2, v3 and v4 arrive while v1 drains: v2 and v3 are superseded (each by the next one to
    arrive), v4 is applied; the ledger's version goes 1 -> 4."""
    async def main():
        async with v1_draining(exp, 1) as ((gen,), c, drain, first):
            waiting = {}
            for v in (2, 3, 4):
                waiting[v] = asyncio.ensure_future(c.weights_published(disk(v)))
                await until(lambda v=v: c.pending.newest_waiting() == v)
            assert [(await waiting[v]).superseded_by for v in (2, 3)] == [3, 4]
            drain.set()
            assert (await first).superseded_by == 0 and (await waiting[4]).superseded_by == 0
            assert loaded(gen) == ["1", "4"] and c.ledger.version == 4 and c.pending.superseded == 2

    asyncio.run(main())


def test_a_broadcast_is_never_skipped(exp):
    """A broadcast's tensors are sent while the servers receive them: once announced it is
    applied, and a later disk version waits behind it instead of superseding it."""
    async def main():
        async with v1_draining(exp, 1) as ((gen,), c, drain, first):
            bcast = asyncio.ensure_future(c.weights_published(WeightsBroadcast(
                version=2, group_name="tandem-weights-v2", master_address="127.0.0.1", master_port=29555,
                world_size=2, names=["a"], dtypes=["float32"], shapes=[[4]])))
            third = asyncio.ensure_future(c.weights_published(disk(3)))
            await until(lambda: c.pending.newest_waiting() == 3)
            assert not bcast.done()
            drain.set()
            acks = [await first, await bcast, await third]
            assert [(a.version, a.superseded_by) for a in acks] == [(1, 0), (2, 0), (3, 0)]
            assert loaded(gen) == ["1", "2", "3"] and c.ledger.version == 3

    asyncio.run(main())
