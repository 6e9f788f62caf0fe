"""Weight broadcast from the trainer's `BroadcastPublisher` to a receiver process over a real gloo
group: every tensor arrives (the check against the real server is
tests/integration/generation/test_gen_trainer_broadcast.py).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from tandem.services.protocol import WeightsBroadcast
from tandem.trainer.config import TrainerConfig
from tandem.trainer.torch_backend import TorchBackend
from tandem.trainer.weights import BackgroundCall
from tandem.trainer.weights.broadcast import BroadcastPublisher


def backend(model_dir):
    return TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), model_dir, 0)


RECEIVER = textwrap.dedent('''
    """A generation-server stand-in: joins with the rendezvous every server uses, receives tensors."""
    import json, os, sys
    import torch, torch.distributed as dist
    from tandem.services.protocol.weight_group import join_weight_group, leave_weight_group
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
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without an
    # active exception") after the work is done and saved, which is not what this checks.
    os._exit(0)
''')


def test_broadcast_sends_every_tensor_to_a_receiver_process(small_model_dir, tmp_path):
    """Real two-process gloo group; the receiver is a separate process joining as a server does
    (the end-to-end check against the real server is tests/integration/generation/test_gen_trainer_broadcast.py)."""
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
