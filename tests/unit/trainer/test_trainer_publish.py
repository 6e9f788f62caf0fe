"""Weight publishing (trainer/weights/): atomic HF directories on disk (last K kept) and the
factory that picks the publisher from trainer.weight_sync. The broadcast to a receiver process
over a gloo group is in tests/integration/trainer/test_trainer_broadcast_receiver.py.
"""
from __future__ import annotations

import errno

import pytest
import torch
from safetensors.torch import load_file

from tandem.services.protocol import WeightsOnDisk
from tandem.trainer.config import TrainerConfig
from tandem.trainer.torch_backend import TorchBackend
from tandem.trainer.weights import build_publisher, transfer_path
from tandem.trainer.weights.broadcast import BroadcastPublisher
from tandem.trainer.weights.disk import DiskPublisher, published_versions, stale_versions


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


def test_a_resumed_trainer_deletes_the_abandoned_future_not_its_fresh_versions(small_model_dir, tmp_path):
    """The first launch published v1..v5 and checkpointed at v2; the resumed trainer publishes v3:
    the old v3..v5 are gone (v3 replaced), and v3 is kept although "newer" directories existed."""
    be = backend(small_model_dir)
    root = tmp_path / "weights"
    for v in (1, 2, 3, 4, 5):
        (root / f"v{v}").mkdir(parents=True)
    DiskPublisher(root, keep=2).publish(be, 3)
    assert published_versions(root) == [2, 3]
    assert (root / "v3" / "model.safetensors").exists()
    assert stale_versions([1, 2, 3, 7, 9], current=3, keep=2) == [1, 7, 9]
    assert stale_versions([4, 5], current=5, keep=3) == []


class _FullDisk:
    """A STAND-IN backend whose export fails as a full disk fails it (ENOSPC after part of a
    file): a real full disk needs a mount the unit tier does not make; a tmpfs run showed the
    half-written version left behind before."""
    rank, world_size = 0, 1

    def export_hf(self, out):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_publish_stopped_by_a_full_disk_leaves_no_half_version_and_a_dead_ones_is_cleared(
        small_model_dir, tmp_path):
    root = tmp_path / "weights"
    publisher = DiskPublisher(root, keep=2)
    publisher.publish(backend(small_model_dir), 1)
    with pytest.raises(OSError, match="No space left"):
        publisher.publish(_FullDisk(), 2)
    assert sorted(p.name for p in root.iterdir()) == ["v1"]
    for left in (".v5.tmp-4242", ".v4.old-4242"):    # a trainer SIGKILLed mid-publish, earlier
        (root / left).mkdir()
        (root / left / "model.safetensors").write_bytes(b"half")
    publisher.publish(backend(small_model_dir), 2)
    assert sorted(p.name for p in root.iterdir()) == ["v1", "v2"]


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

    from tandem.trainer.loop import Trainer

    def ranks(**gen):
        return Trainer._receiver_ranks(SimpleNamespace(cfg=SimpleNamespace(gen=SimpleNamespace(**gen))))
    assert ranks(num_servers=3, tp_size=4, backend="sglang") == 12
    assert ranks(num_servers=3, tp_size=4, backend="embedded") == 3
