"""A disk version through the servers' weight relays (`gen.weight_relay`), driven by the real
controller: real relays over TCP (rollout/server/relay.py, one directory per node) and
`RecordingGenServer`s (see test_controller_weight_sync.py for why), which record the directory
each server was told to load."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from sync_support import ADMIN_KEY, make_controller, servers, settle, shutdown

from tandem.rollout.server.relay import WeightRelay
from tandem.services.protocol import RegisterServer, StatusRequest, WeightsOnDisk, read_metrics

pytestmark = pytest.mark.timeout(90)


def publish(root: Path, version: int) -> Path:
    d = root / "weights" / f"v{version}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(6 << 20))
    (d / "config.json").write_text("{}")
    return d


def run_relayed(exp, tmp_path, nodes: list[int], break_node: int | None = None):
    """Servers on `nodes` (node index per server; a node's servers share its relay directory),
    version 1 published; the relay of every server of `break_node` stopped before the sync."""
    async def main():
        gens = await servers(len(nodes), admin_key=ADMIN_KEY)
        relays = [WeightRelay(tmp_path / f"node{n}", ADMIN_KEY, host="127.0.0.1").start() for n in nodes]
        c = make_controller(exp)
        try:
            for g, r, n in zip(gens, relays, nodes, strict=True):
                c.register_server(RegisterServer(address=g.url, api_key_ref="gen-api-key",
                                                 admin_key_ref="gen-admin-api-key", relay=f"127.0.0.1:{r.port}",
                                                 relay_node=f"node{n}"))
            await settle(c)
            for r, n in zip(relays, nodes, strict=True):
                if n == break_node:
                    r.close()
            src = publish(tmp_path, 1)
            ack = await c.weights_published(WeightsOnDisk(version=1, path=str(src)))
            loaded = [[body["model_path"] for path, body in g.calls if path == "/update_weights_from_disk"]
                      for g in gens]
            state = {s["address"]: s for s in c.status(StatusRequest()).state["servers"]}
            return ack, loaded, [state[g.url] for g in gens], src
        finally:
            await shutdown(c, gens)
            for r, n in zip(relays, nodes, strict=True):
                if n != break_node:
                    r.close()
    return asyncio.run(main())


def test_every_server_loads_its_node_copy_of_the_version(exp, tmp_path):
    ack, loaded, state, src = run_relayed(exp, tmp_path, nodes=[0, 0, 1, 2])
    assert [s["relay_node"] for s in state] == ["node0", "node0", "node1", "node2"]   # shown by --status
    assert ack.ok and "relay_s" in ack.timings and ack.failed_servers == []
    assert loaded == [[str(tmp_path / "node0" / "v1")]] * 2 + [[str(tmp_path / f"node{n}" / "v1")] for n in (1, 2)]
    for n in range(3):
        assert (tmp_path / f"node{n}" / "v1" / "model.safetensors").read_bytes() == \
            (src / "model.safetensors").read_bytes()


def test_a_node_whose_relay_is_gone_reads_the_shared_directory_and_the_chain_after_it_is_retried(exp, tmp_path):
    """Node 1's relay is stopped: node 2, which streamed from it, gets its copy in the retry (from
    the shared directory); node 1's server loads the shared directory itself and stays in
    rotation; the sync records why."""
    ack, loaded, state, src = run_relayed(exp, tmp_path, nodes=[0, 1, 2], break_node=1)
    assert ack.ok and ack.failed_servers == []
    assert loaded == [[str(tmp_path / "node0" / "v1")], [str(src)], [str(tmp_path / "node2" / "v1")]]
    assert all(s["in_rotation"] for s in state)
    (record,) = [r for r in read_metrics(exp, "controller") if r.get("event") == "weight_sync"]
    assert list(record["relay_fallback"]) == ["node1"] and "Connect" in record["relay_fallback"]["node1"]


def test_servers_without_a_relay_read_the_shared_directory(exp, tmp_path):
    async def main():
        gens = await servers(1, admin_key=ADMIN_KEY)
        c = make_controller(exp)
        try:
            c.register_server(RegisterServer(address=gens[0].url, api_key_ref="gen-api-key",
                                             admin_key_ref="gen-admin-api-key"))
            await settle(c)
            ack = await c.weights_published(WeightsOnDisk(version=1, path="/shared/w/v1"))
            return ack, gens[0].calls
        finally:
            await shutdown(c, gens)
    ack, calls = asyncio.run(main())
    assert ack.ok and "relay_s" not in ack.timings
    assert [b["model_path"] for p, b in calls if p == "/update_weights_from_disk"] == ["/shared/w/v1"]


@pytest.mark.parametrize("relay, node, why", [("127.0.0.1", "n", "host:port"), ("h:1", "", "relay_node")])
def test_a_bad_relay_registration_is_refused_naming_the_field(exp, relay, node, why):
    c = make_controller(exp)
    with pytest.raises(ValueError, match=why):
        c.register_server(RegisterServer(address="http://127.0.0.1:1", relay=relay, relay_node=node))
