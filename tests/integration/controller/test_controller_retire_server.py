"""Retiring a generation server (`retire_server`, the controller's part of the elastic split) with
requests in flight: they come back aborted, are routed to the other server by the controller and
finish there with every token they had; the retired server gets nothing more; a bad retirement
is an error reply and the controller goes on serving.

Real pieces: the controller in this process serving its CURVE ROUTER socket, two `tandem gen
serve` processes (the embedded server, real HTTP, API and admin keys as the launcher gives
them), and the rollout worker's own routing (`ControllerRouting` over a `RequestClient`) inside
the real `GenerationClient`.
"""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from process_starts import gen_server
from sync_support import ADMIN_KEY, KEY, make_controller

from tandem.rollout.client import AdminClient, GenerationClient, server_load
from tandem.rollout.worker_cli import ControllerRouting
from tandem.services.protocol import (
    PickServer,
    RegisterServer,
    RemoteError,
    RequestClient,
    RetireServer,
    StatusRequest,
    load_keys,
)

pytestmark = pytest.mark.timeout(300)
TOKENS = 160


class GenProcess:
    """One `tandem gen serve` with the experiment's key files (its URL from its first line)."""

    def __init__(self, model: Path, exp, name: str):
        self.log_path = exp.root / f"{name}.log"
        self.proc, self.url = gen_server(["--model", str(model), "--api-key-file", str(exp.keys / "gen-api-key"),
                                          "--admin-api-key-file", str(exp.keys / "gen-admin-api-key")],
                                         self.log_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def two_servers(exp, tiny_model_dir):
    (exp.keys / "gen-api-key").write_text(KEY + "\n")
    (exp.keys / "gen-admin-api-key").write_text(ADMIN_KEY + "\n")
    gens = []
    try:
        gens = [GenProcess(tiny_model_dir, exp, f"gen-{i}") for i in range(2)]
        yield gens
    finally:
        for g in gens:
            g.stop()


async def load_of(url: str) -> int:
    """Requests running + waiting on the server at `url` (its `/v1/loads`)."""
    admin = AdminClient(url, KEY, 5.0, admin_key=ADMIN_KEY)
    try:
        return server_load(await admin.loads(5.0))
    finally:
        await admin.close()


def test_retired_server_hands_its_requests_to_the_other(exp, two_servers):
    a, b = two_servers

    async def main():
        c = make_controller(exp)
        c.server = c._bind()
        serving = asyncio.ensure_future(c.server.serve_forever())
        for g in (a, b):
            c.register_server(RegisterServer(address=g.url, api_key_ref="gen-api-key",
                                             admin_key_ref="gen-admin-api-key"))
        client = RequestClient(load_keys(exp.keys), c.server.address, timeout_s=60)
        routing = ControllerRouting(exp, client, "w")
        first_pick: dict[str, str] = {}

        async def picker(key, exclude):
            ref = await routing(key, exclude)
            first_pick.setdefault(key, ref.url)
            return ref

        params = {"temperature": 1.0, "max_new_tokens": TOKENS, "ignore_eos": True}
        try:
            async with GenerationClient(picker, seed_mode="stream") as gen:
                samples = [asyncio.ensure_future(gen.generate([5, 6, 7, 8 + i], dict(params), sticky_key=f"g/{i}"))
                           for i in range(6)]
                deadline = time.monotonic() + 60
                while await load_of(a.url) == 0:   # requests running on the server to retire
                    assert time.monotonic() < deadline, "no request reached the first server"
                    await asyncio.sleep(0.02)
                reply = await client.request(RetireServer(address=a.url + "/", timeout_s=30))
                assert "paused (abort)" in reply.detail, reply.detail
                results = await asyncio.wait_for(asyncio.gather(*samples), 240)
                # New work after the retirement: none of it goes to the retired server.
                later = await asyncio.wait_for(asyncio.gather(*(
                    gen.generate([9, 9, 9 + i], {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True},
                                 sticky_key=f"g/{i}") for i in range(6))), 120)
            on_a = [i for i in range(6) if first_pick[f"g/{i}"] == a.url]
            assert on_a, first_pick
            for i, res in enumerate(results):
                assert len(res.output_ids) == TOKENS and res.finish_reason == "length", (i, res)
                assert len(res.output_logprobs) == len(res.output_versions) == TOKENS
                assert res.server == b.url, (i, res.server)
                assert res.failovers == 0, (i, res)   # moved by the controller, not by a dead server
                if i in on_a:
                    assert res.interruptions >= 1, (i, res)
            assert all(r.server == b.url for r in later)
            # The retired server is paused and idle: no request reached it after its pause (one
            # that had would still wait there, and its sample would not have finished).
            assert await load_of(a.url) == 0
            for i in range(20):
                choice = await client.request(PickServer("w", f"new/{i}"))
                assert choice.address == b.url
            state = (await client.request(StatusRequest())).state
            assert [s["address"] for s in state["servers"]] == [b.url]
            retired = [r for r in _records(exp) if r.get("event") == "server_retired"]
            assert [r["server"] for r in retired] == [a.url]

            # Mistakes are error replies naming the problem; the controller keeps serving.
            with pytest.raises(RemoteError, match="not a registered generation server"):
                await client.request(RetireServer(address="http://127.0.0.1:1"))
            with pytest.raises(RemoteError, match="only generation server"):
                await client.request(RetireServer(address=b.url))
            assert (await client.request(PickServer("w", "after"))).address == b.url
        finally:
            client.close()
            c.server.close()
            serving.cancel()
            if c._http is not None:
                await c._http.close()

    asyncio.run(main())


def _records(exp) -> list[dict]:
    from tandem.services.protocol import read_metrics
    return read_metrics(exp)
