"""The controller as a real process (`tandem controller --exp DIR`) over real CURVE sockets:
hundreds of concurrent workers, a trainer advancing versions, SIGKILL and restart, leases."""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from controller_helpers import write_config

from tandem.services.protocol import (
    AdmitRequest,
    GroupDone,
    Heartbeat,
    RemoteError,
    RequestClient,
    StatusRequest,
    WeightsOnDisk,
    load_keys,
    read_metrics,
    read_service,
)

pytestmark = pytest.mark.timeout(120)


class Fleet:
    """Simulated rollout workers sharing a few DEALER sockets, plus a simulated trainer."""

    def __init__(self, exp, n_workers: int, B: int, sockets: int = 4, timeout_s: float = 2.0):
        keys = load_keys(exp.keys)
        resolve = lambda: read_service(exp, "controller", timeout_s=10)["address"]  # noqa: E731
        self.clients = [RequestClient(keys, resolve, timeout_s=timeout_s) for _ in range(sockets)]
        self.n, self.B = n_workers, B
        self.tickets: list[tuple[str, int]] = []          # every ticket a worker received
        self.reported = Counter()                         # acknowledged reports by status
        self.accepted_versions = Counter()                # admit_version of accepted groups
        self.running: dict[str, set[str]] = {}
        self.version = 0
        self.stop = False
        self.rng = random.Random(11)

    async def call(self, i: int, body):
        """Retry through timeouts (the controller may be restarting); errors propagate."""
        while True:
            try:
                return await self.clients[i % len(self.clients)].request(body)
            except TimeoutError:
                await asyncio.sleep(0.05)

    async def worker(self, i: int) -> None:
        wid = f"worker-{i}"
        mine = self.running.setdefault(wid, set())
        while not self.stop:
            reply = await self.call(i, AdmitRequest(wid, max_groups=1))
            if not reply.tickets:
                await asyncio.sleep(reply.retry_after_s * self.rng.random())
                continue
            for t in reply.tickets:
                self.tickets.append((t.group_id, t.admit_version))
                mine.add(t.group_id)
                await asyncio.sleep(self.rng.random() * 0.01)
                status = self.rng.choices(["accepted", "rejected", "failed"], [7, 2, 1])[0]
                try:
                    await self.call(i, GroupDone(wid, t.group_id, status))
                except RemoteError as e:   # only a group released by the controller may say so
                    raise AssertionError(f"report of {t.group_id} refused: {e}") from None
                mine.discard(t.group_id)
                self.reported[status] += 1
                if status == "accepted":
                    self.accepted_versions[t.admit_version] += 1

    async def heartbeats(self, i: int, period_s: float = 0.3) -> None:
        wid = f"worker-{i}"
        while not self.stop:
            await asyncio.sleep(period_s)
            reply = await self.call(i, Heartbeat(wid, sorted(self.running.get(wid, ()))))
            assert reply.revoked == [], reply.revoked

    async def trainer(self, until_version: int) -> None:
        """Publishes version v+1 once B groups per version have been accepted."""
        while self.version < until_version:
            if self.reported["accepted"] >= self.B * (self.version + 1):
                ack = await self.call(0, WeightsOnDisk(version=self.version + 1, path="/weights"))
                assert ack.ok and ack.version == self.version + 1
                self.version += 1
            await asyncio.sleep(0.01)

    async def status(self) -> dict:
        return (await self.call(0, StatusRequest())).state

    def close(self) -> None:
        for c in self.clients:
            c.close()


async def settle(fleet: Fleet) -> dict:
    """Heartbeat until the controller runs nothing: tickets whose reply was lost (killed process)
    or came after the worker had given up and asked again are released as orphans."""
    for _ in range(100):
        state = await fleet.status()
        if state["running"] == 0:
            return state
        for i in range(fleet.n):
            await fleet.call(i, Heartbeat(f"worker-{i}", []))
        await asyncio.sleep(0.1)
    return state


def check_accounting(fleet: Fleet, state: dict) -> None:
    """Nothing lost, nothing counted twice: accepted and rejected are what the workers reported;
    failed = reported failures + tickets granted that no worker ever received."""
    assert state["accepted"] == fleet.reported["accepted"]
    assert state["rejected"] == fleet.reported["rejected"]
    assert state["running"] == 0
    never_received = state["admitted"] - len(fleet.tickets)
    assert never_received >= 0
    assert state["failed"] == fleet.reported["failed"] + never_received
    assert len({g for g, _ in fleet.tickets}) == len(fleet.tickets)


def check_bound(fleet: Fleet, eta: int) -> None:
    for v in range(fleet.version + 1):
        assert sum(n for av, n in fleet.accepted_versions.items() if av <= v) <= fleet.B * (eta + v + 1)


async def run_fleet(fleet: Fleet, until_version: int, on_version=None) -> None:
    tasks = [asyncio.ensure_future(fleet.worker(i)) for i in range(fleet.n)]
    tasks += [asyncio.ensure_future(fleet.heartbeats(i)) for i in range(fleet.n)]
    trainer = asyncio.ensure_future(fleet.trainer(until_version))
    try:
        while not trainer.done():
            await asyncio.wait([trainer, *tasks], timeout=0.05, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()
            if on_version:
                await on_version(fleet.version)
        trainer.result()
    finally:
        fleet.stop = True
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)


def test_hundreds_of_concurrent_workers_keep_the_staleness_bound(exp, controller_proc):
    B, eta = 8, 1
    write_config(exp, groups_per_step=B, max_staleness=eta, max_concurrent_groups=64, retry_after_s=0.02)
    proc = controller_proc()
    proc.start()

    async def main():
        fleet = Fleet(exp, n_workers=300, B=B, timeout_s=10.0)
        try:
            await run_fleet(fleet, until_version=6)
            return fleet, await settle(fleet)
        finally:
            fleet.close()

    fleet, state = asyncio.run(main())
    assert state["version"] == 6
    check_accounting(fleet, state)
    check_bound(fleet, eta)
    assert proc.stop() == 0


def test_sigkill_and_restart_lose_and_double_count_nothing(exp, controller_proc):
    B, eta = 6, 1
    write_config(exp, groups_per_step=B, max_staleness=eta, max_concurrent_groups=48, retry_after_s=0.02)
    first = controller_proc()
    first.start()
    killed = []

    async def main():
        fleet = Fleet(exp, n_workers=120, B=B, timeout_s=1.0)

        async def kill_at_version(v):
            if v >= 3 and not killed:
                first.kill()                      # SIGKILL, mid-traffic
                killed.append(v)
                await asyncio.sleep(0.3)
                second = controller_proc()
                await asyncio.get_running_loop().run_in_executor(None, second.start)
        try:
            await run_fleet(fleet, until_version=6, on_version=kill_at_version)
            return fleet, await settle(fleet)
        finally:
            fleet.close()

    fleet, state = asyncio.run(main())
    assert killed and state["epoch"] >= 1 and state["version"] == 6
    check_accounting(fleet, state)
    check_bound(fleet, eta)


def test_a_vanished_worker_releases_its_slots_after_the_lease(exp, controller_proc):
    write_config(exp, groups_per_step=3, max_staleness=0, lease_s=0.6, metrics_interval_s=0.2)
    proc = controller_proc()
    address = proc.start()

    async def main():
        keys = load_keys(exp.keys)
        ghost, other = RequestClient(keys, address, 20), RequestClient(keys, address, 20)
        try:
            got = (await ghost.request(AdmitRequest("ghost", 10))).tickets
            assert len(got) == 3
            ghost.close()                                  # vanishes without a word
            assert (await other.request(AdmitRequest("other", 10))).tickets == []
            for _ in range(40):
                await asyncio.sleep(0.1)
                tickets = (await other.request(AdmitRequest("other", 10))).tickets
                if tickets:
                    break
            state = (await other.request(StatusRequest())).state
            # "other" must stay alive meanwhile: its own requests renewed its lease
            return got, tickets, state
        finally:
            other.close()

    got, tickets, state = asyncio.run(main())
    assert len(tickets) == 3 and state["failed"] == 3 and state["running"] == 3
    proc.stop()
    records = read_metrics(exp, "controller")
    admission = [r for r in records if r.get("event") == "admission"]
    assert admission and {"capacity", "running", "accepted", "rejected", "failed", "version",
                          "admissions_per_s"} <= set(admission[-1])
