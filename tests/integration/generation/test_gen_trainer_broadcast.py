"""The trainer and the generation server interoperate over a torch.distributed weight broadcast.

Both ends are the project's real code: the trainer's `BroadcastPublisher` sends the parameters of
a `TorchBackend` (the tiny model with changed weights) from this test process as rank 0, while a
real `tandem gen serve` subprocess joins as rank 1 because `AdminClient` drives its
`/init_weights_update_group` and `/update_weights_from_distributed`, the way the controller does.
Neither side is a stand-in, so a rendezvous that only one of them speaks (different store keys)
fails here. The server's next greedy generation must then score exactly as a transformers forward
of the weights that were sent. gloo on CPU takes the same code path NCCL takes on GPUs.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from gen_support import reference_logprobs

from tandem.rollout.client import AdminClient
from tandem.trainer.config import TrainerConfig
from tandem.trainer.torch_backend import TorchBackend
from tandem.trainer.weights import BackgroundCall
from tandem.trainer.weights.broadcast import BroadcastPublisher

PROMPT = [1, 6, 57, 50, 58]
NEW_TOKENS = 24
VERSION = 1


def changed_backend(model_dir) -> TorchBackend:
    """The trainer's backend on the served model, every parameter moved (as after some steps)."""
    be = TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), model_dir, 0)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return be


async def drive_server(server, ready) -> None:
    """What the controller does on a WeightsBroadcast (services/controller/weights/broadcast.py),
    through the published admin client: the update inside a weight-update session."""
    async with AdminClient(server.url, server.api.api_key, timeout_s=90) as admin:
        await admin.begin_weight_update()
        try:
            await admin.init_weights_update_group(ready.master_address, ready.master_port, 1, ready.world_size,
                                                  ready.group_name, backend="gloo")
            await admin.update_weights_from_distributed(ready.names, ready.dtypes, ready.shapes,
                                                        ready.group_name, weight_version=ready.version)
            await admin.destroy_weights_update_group(ready.group_name)
        finally:
            await admin.end_weight_update()


def greedy(server) -> tuple[list[int], list[float], str]:
    out = server.api.generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"], logprobs, str(out["meta_info"]["weight_version"])


def test_trainer_broadcast_updates_a_real_server(own_server, tiny_model_dir, tmp_path):
    be = changed_backend(tiny_model_dir)
    sent_dir = tmp_path / "sent"
    be.export_hf(sent_dir)          # the reference: exactly the tensors the trainer broadcasts
    pub = BroadcastPublisher("127.0.0.1", 0, receiver_ranks=1, timeout_s=60).publish(be, VERSION)
    ready, send = pub.message, pub.transfer

    sender = BackgroundCall(send, name="trainer broadcast")
    asyncio.run(drive_server(own_server, ready))
    timings = sender.result(60)
    assert timings["bytes"] == sum(p.numel() * p.element_size() for p in be.model.parameters())

    ids, logprobs, version = greedy(own_server)
    assert version == str(VERSION)
    assert logprobs == pytest.approx(reference_logprobs(sent_dir, PROMPT, ids, 1.0), abs=1e-4)
    # The sent weights really differ from the ones served before (otherwise the check proves nothing).
    before = reference_logprobs(tiny_model_dir, PROMPT, ids, 1.0)
    assert max(abs(a - b) for a, b in zip(before, logprobs, strict=True)) > 1e-2
