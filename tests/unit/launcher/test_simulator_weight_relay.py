"""How the simulator prices `gen.weight_relay` (disk weights passed down a chain of generation
nodes): one shared-filesystem read per version, whatever the number of servers, plus one
chunk's time per node of the chain; and `gen.weight_relay: false` leaves the disk price as it was.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.launcher.config import load_config
from tandem.launcher.simulate.costs import Layout, physical_costs
from tandem.launcher.simulate.hardware import load_gpu, load_model_shape
from tandem.launcher.simulate.scenario import build, simulate
from tandem.rollout.client.relay import CHUNK_BYTES

GPU = load_gpu("H800")
MODEL = load_model_shape("R1-Distill-Qwen-1.5B")
DISK_GBPS = 20.0
NODE_NET = GPU.node_network_bw * GPU.eff.network     # a whole node's NIC, as a relay stream has


def _costs(servers: int, *, gen_tp: int = 1, relay: bool, weight_sync: str = "disk",
           disk_gbps: float = DISK_GBPS, colocated: bool = False):
    layout = Layout(gen_tp=gen_tp, num_servers=servers, train_gpus=8, train_tp=1, train_pp=1, gpus_per_node=8)
    return physical_costs(GPU, MODEL, layout, mem_fraction=0.85, max_running=64, weight_sync=weight_sync,
                          disk_gbps=disk_gbps, colocated=colocated, relay=relay)


def test_relay_load_grows_only_by_one_chunk_per_node():
    # 8 and 64 nodes of 8 TP-1 servers: 56 more nodes in the chain, 448 more servers.
    small, large = _costs(8 * 8, relay=True), _costs(64 * 8, relay=True)
    assert large.load_s - small.load_s == pytest.approx(56 * CHUNK_BYTES / NODE_NET, rel=1e-9)
    # The read itself: one copy at the filesystem's rate (slower than a node's NIC here).
    w = MODEL.weight_bytes
    assert small.load_s == pytest.approx(w / (DISK_GBPS * 1e9) + 7 * CHUNK_BYTES / NODE_NET, rel=1e-12)
    # The trainer writes one copy, as with plain disk sync.
    assert small.publish_s == large.publish_s == _costs(8, relay=False).publish_s
    assert any("weight relay" in n and "64 node(s)" in n for n in large.notes)


def test_disk_load_grows_linearly_with_the_servers():
    w = MODEL.weight_bytes
    for servers in (1, 8, 64, 512):
        assert _costs(servers, relay=False).load_s == pytest.approx(w * servers / (DISK_GBPS * 1e9), rel=1e-12)
    assert _costs(512, relay=False).load_s / _costs(64, relay=False).load_s == pytest.approx(8)


def test_servers_of_one_node_share_its_copy():
    # 8 TP-1 servers, 4 TP-2 servers and 1 TP-8 server fill one node: the same chain of one.
    one_node = {_costs(8 // tp, gen_tp=tp, relay=True).load_s for tp in (1, 2, 4, 8)}
    assert len(one_node) == 1
    # A ninth TP-1 server opens a second node (one more chunk); a partly filled node counts whole.
    nine, sixteen = _costs(9, relay=True).load_s, _costs(16, relay=True).load_s
    assert nine - one_node.pop() == pytest.approx(CHUNK_BYTES / NODE_NET, rel=1e-9)
    assert nine == sixteen
    assert Layout(gen_tp=2, num_servers=5, train_gpus=8, train_tp=1, train_pp=1, gpus_per_node=8).gen_nodes == 2


@pytest.mark.parametrize("gen_tp", [1, 2, 8])
@pytest.mark.parametrize("servers", [1, 2, 3, 8, 64, 384])
def test_relay_never_loads_slower_than_disk_when_the_filesystem_is_slower_than_a_nic(servers, gen_tp):
    # With the filesystem (20 GB/s) slower than one node's NIC (320 GB/s effective), a relay
    # reads one copy at the filesystem's rate where disk reads one per server; each extra node
    # costs a chunk at NIC rate, far less than a whole copy at the filesystem's.
    relay, disk = _costs(servers, gen_tp=gen_tp, relay=True), _costs(servers, gen_tp=gen_tp, relay=False)
    if servers == 1:
        assert relay.load_s == pytest.approx(disk.load_s, rel=1e-12)
    else:
        assert relay.load_s < disk.load_s


def test_one_server_with_a_filesystem_faster_than_a_nic_pays_the_nic():
    # The relay's one read goes through a node's NIC: a single server reading a 1 TB/s
    # filesystem directly is faster than the relay's first node can receive.
    relay, disk = _costs(1, relay=True, disk_gbps=1000.0), _costs(1, relay=False, disk_gbps=1000.0)
    assert relay.load_s == pytest.approx(MODEL.weight_bytes / NODE_NET, rel=1e-12)
    assert relay.load_s > disk.load_s


def test_relay_prices_only_the_filesystem_path():
    for kw in ({"weight_sync": "broadcast"}, {"colocated": True}):
        on, off = _costs(64, relay=True, **kw), _costs(64, relay=False, **kw)
        assert (on.publish_s, on.load_s) == (off.publish_s, off.load_s)
    assert any("gen.weight_relay ignored" in n for n in _costs(64, relay=True, weight_sync="broadcast").notes)


def _cfg(*overrides):
    base = ["experiment.name=t", "experiment.model=m", "launcher.backend=slurm", "gen.backend=sglang",
            "simulate.model_size=R1-Distill-Qwen-1.5B", "simulate.hardware=H800",
            "launcher.nodes=1", "launcher.gen_train_ratio='1:1'", "trainer.groups_per_step=4",
            "rollout.n_samples=1", "rollout.max_new_tokens=4096", "controller.max_concurrent_groups=100000",
            "rollout.concurrency=100000", "controller.max_staleness=0", "simulate.output_lengths=fixed",
            "simulate.output_median=1000", "simulate.steps=2", "simulate.warmup_steps=1",
            "rollout.max_prompt_tokens=512", "trainer.max_tokens_per_mb=8704"]
    return load_config(None, base + list(overrides))


@pytest.mark.parametrize("nodes", [1, 8, 64])
def test_weight_relay_false_leaves_the_disk_price_as_it_was(nodes):
    # The price before the relay existed: one write, then every server reads its own copy.
    sc = build(_cfg(f"launcher.nodes={nodes}", "launcher.gen_train_ratio='3:1'"))
    assert sc.cfg.gen.weight_relay is False
    w, disk = MODEL.weight_bytes, DISK_GBPS * 1e9
    assert sc.costs.publish_s == w / disk
    assert sc.costs.load_s == w * sc.layout.num_servers / disk
    assert not any("relay" in n for n in sc.notes)
    relay = build(_cfg(f"launcher.nodes={nodes}", "launcher.gen_train_ratio='3:1'", "gen.weight_relay=true"))
    gen_nodes = math.ceil(nodes * 3 / 4)   # 3:1 of 8-GPU nodes, TP-1 servers
    assert relay.layout.gen_nodes == gen_nodes
    assert relay.costs.load_s == pytest.approx(w / disk + (gen_nodes - 1) * CHUNK_BYTES / NODE_NET, rel=1e-12)
    assert any("weight relay" in n for n in relay.notes)


def test_a_synchronous_step_is_shorter_by_exactly_the_load_the_relay_saves():
    # eta 0 with the trainer waiting for the loads: the load is on every step's path, so the
    # relay shortens a step by disk's load minus its own (4 servers on one node: 3 copies' reads).
    (disk_sc, disk), (relay_sc, relay) = simulate(_cfg()), simulate(_cfg("gen.weight_relay=true"))
    saved = disk_sc.costs.load_s - relay_sc.costs.load_s
    assert saved == pytest.approx(3 * MODEL.weight_bytes / (DISK_GBPS * 1e9), rel=1e-12)
    assert np.diff(disk.step_times[1:]) - np.diff(relay.step_times[1:]) == pytest.approx([saved] * 2, rel=1e-9)
