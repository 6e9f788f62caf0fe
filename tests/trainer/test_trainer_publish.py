"""Weight publishing (trainer/weights/): atomic HF directories on disk (last K kept), broadcast over
a gloo group, and the factory that picks the publisher from trainer.weight_sync."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from services.protocol import WeightsBroadcast, WeightsOnDisk
from trainer.config import TrainerConfig
from trainer.torch_backend import TorchBackend
from trainer.weights import BackgroundCall, build_publisher, transfer_path
from trainer.weights.broadcast import BroadcastPublisher
from trainer.weights.disk import DiskPublisher, published_versions


def backend(model_dir):
    return TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), model_dir, 0)


def test_disk_publish_is_atomic_loadable_and_keeps_the_last_k(small_model_dir, tmp_path):
    be = backend(small_model_dir)
    root = tmp_path / "weights"
    publisher = DiskPublisher(root, keep=2)
    for v in range(1, 5):
        with torch.no_grad():
            be.model.model.norm.weight.fill_(float(v))
        pub = publisher.publish(be, v)
        assert pub.message == WeightsOnDisk(version=v, path=str(root / f"v{v}")) and pub.transfer is None
        assert set(pub.timings) == {"export_s", "rename_s", "prune_s"}
    assert published_versions(root) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v4"]   # no temp directory left behind
    files = {p.name for p in (root / "v4").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert float(load_file(root / "v4" / "model.safetensors")["model.norm.weight"][0]) == 4.0
    # republishing an existing version (after a crash) replaces it whole
    with torch.no_grad():
        be.model.model.norm.weight.fill_(9.0)
    publisher.publish(be, 4)
    assert float(load_file(root / "v4" / "model.safetensors")["model.norm.weight"][0]) == 9.0


RECEIVER = textwrap.dedent('''
    """A generation-server stand-in: joins with the rendezvous every server uses, receives tensors."""
    import json, sys
    import torch, torch.distributed as dist
    from services.protocol.weight_group import join_weight_group, leave_weight_group
    ready = json.loads(sys.argv[1])
    pg = join_weight_group(ready["master_address"], ready["master_port"], 1, ready["world_size"],
                           ready["group_name"], backend="gloo", timeout_s=60)
    got = {}
    for name, dtype, shape in zip(ready["names"], ready["dtypes"], ready["shapes"]):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=pg)
        got[name] = t
    leave_weight_group(pg)
    torch.save(got, sys.argv[2])
''')


def test_broadcast_sends_every_tensor_to_a_receiver_process(small_model_dir, tmp_path):
    """Real two-process gloo group; the receiver is a separate process joining as a server does
    (the end-to-end check against the real server is tests/generation/test_gen_trainer_broadcast.py)."""
    import json
    be = backend(small_model_dir)
    pub = BroadcastPublisher("127.0.0.1", 0, receiver_ranks=1, timeout_s=60).publish(be, version=3)
    ready, send = pub.message, pub.transfer
    assert isinstance(ready, WeightsBroadcast) and ready.version == 3 and ready.world_size == 2
    script = tmp_path / "receiver.py"
    script.write_text(RECEIVER)
    body = {k: getattr(ready, k) for k in ("master_address", "master_port", "world_size", "group_name",
                                           "names", "dtypes", "shapes")}
    sender = BackgroundCall(send)
    proc = subprocess.run([sys.executable, str(script), json.dumps(body), str(tmp_path / "got.pt")],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    timings = sender.result(60)
    assert timings["bytes"] == sum(p.numel() * 4 for p in be.model.parameters())
    got = torch.load(tmp_path / "got.pt")
    expect = dict(be.full_parameters())
    assert list(got) == list(expect)
    for name, t in expect.items():
        assert torch.equal(got[name], t), name


def test_the_factory_builds_the_configured_publisher_and_sizes_the_group_by_tp_ranks(tmp_path):
    """trainer.weight_sync picks the publisher; a broadcast group has 1 + the servers' TP ranks."""
    disk = build_publisher(TrainerConfig(temperature=1.0, max_staleness=0, weight_sync="disk", keep_weights=5),
                           tmp_path, receiver_ranks=8)
    assert isinstance(disk, DiskPublisher) and disk.root == tmp_path and disk.keep == 5
    bc = build_publisher(TrainerConfig(temperature=1.0, max_staleness=0, weight_sync="broadcast",
                                       wait_for_ack=False), tmp_path, receiver_ranks=8)
    assert isinstance(bc, BroadcastPublisher) and bc.receiver_ranks == 8 and bc.snapshot
    assert (transfer_path("disk"), transfer_path("broadcast")) == ("filesystem", "network")
    with pytest.raises(ValueError, match="unknown method 'ipc'"):
        transfer_path("ipc")
    problems = dict(TrainerConfig(temperature=1.0, max_staleness=0, weight_sync="ipc").problems())
    assert "must be one of ['broadcast', 'disk']" in problems["weight_sync"]


def test_the_broadcast_group_counts_every_tp_rank_of_every_sglang_server():
    """SGLang joins each TP rank at rank_offset + tp_rank: 3 servers x TP 4 = 12 receiving ranks
    (the WeightsBroadcast world size is 13); an embedded server is one process, one rank."""
    from types import SimpleNamespace

    from trainer.loop import Trainer

    def ranks(**gen):
        return Trainer._receiver_ranks(SimpleNamespace(cfg=SimpleNamespace(gen=SimpleNamespace(**gen))))
    assert ranks(num_servers=3, tp_size=4, backend="sglang") == 12
    assert ranks(num_servers=3, tp_size=4, backend="embedded") == 3
