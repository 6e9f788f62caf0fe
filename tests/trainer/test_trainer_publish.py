"""Weight publishing: atomic HF directories on disk (last K kept), broadcast over a gloo group."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from safetensors.torch import load_file

from trainer.config import TrainerConfig
from trainer.publish import BackgroundCall, BroadcastPublisher, publish_to_disk, published_versions
from trainer.torch_backend import TorchBackend


def backend(model_dir):
    return TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), model_dir, 0)


def test_disk_publish_is_atomic_loadable_and_keeps_the_last_k(small_model_dir, tmp_path):
    be = backend(small_model_dir)
    root = tmp_path / "weights"
    for v in range(1, 5):
        with torch.no_grad():
            be.model.model.norm.weight.fill_(float(v))
        path, timings = publish_to_disk(be, root, v, keep=2)
        assert path == root / f"v{v}"
        assert set(timings) == {"export_s", "rename_s", "prune_s"}
    assert published_versions(root) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v4"]   # no temp directory left behind
    files = {p.name for p in (root / "v4").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert float(load_file(root / "v4" / "model.safetensors")["model.norm.weight"][0]) == 4.0
    # republishing an existing version (after a crash) replaces it whole
    with torch.no_grad():
        be.model.model.norm.weight.fill_(9.0)
    publish_to_disk(be, root, 4, keep=2)
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
    ready, send = BroadcastPublisher("127.0.0.1", 0, n_receivers=1, timeout_s=60).prepare(be, version=3)
    assert ready.how == "broadcast" and ready.version == 3 and ready.world_size == 2
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
