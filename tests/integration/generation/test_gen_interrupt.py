"""The interrupt test: a long generation survives pause -> weight update -> continue.

The client's sample must read versions [v0 ... v0, v1 ... v1], and each segment's log-probs must
be those of a fresh transformers forward of the policy that produced it over the same tokens —
through both update paths (a HF directory on disk, and a torch.distributed broadcast over gloo,
the code path NCCL takes on GPUs).
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from gen_support import reference_logprobs

from tandem.rollout.client import GenerationClient, ServerRef
from tandem.services.protocol import free_port

PROMPT = [1, 6, 57, 50, 58, 61]
NEW_TOKENS = 240
TEMPERATURE = 0.8


def wait_for_tokens(api, at_least: int) -> None:
    base = api.get("/get_server_info")[1]["internal_states"][0]["generated_tokens"]
    deadline = time.monotonic() + 60
    while api.get("/get_server_info")[1]["internal_states"][0]["generated_tokens"] < base + at_least:
        assert time.monotonic() < deadline, "generation did not progress"
        time.sleep(0.02)


def generate_through_update(server, update) -> object:
    """Run one long sample; once it is under way, pause, call `update()`, continue."""
    async def run():
        async with GenerationClient([ServerRef(server.url, server.api.api_key)]) as client:
            task = asyncio.ensure_future(client.generate(
                PROMPT, {"max_new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "ignore_eos": True,
                         "sampling_seed": 5}))
            await asyncio.to_thread(wait_for_tokens, server.api, 20)
            status, reply = await asyncio.to_thread(server.api.post, "/pause_generation", {"mode": "abort"})
            assert status == 200, reply
            await asyncio.to_thread(update)
            status, reply = await asyncio.to_thread(server.api.post, "/continue_generation")
            assert status == 200, reply
            return await task
    return asyncio.run(run())


def check_segments(res, old_dir, new_dir, old: int, new: int) -> None:
    assert len(res.output_ids) == NEW_TOKENS and res.finish_reason == "length"
    cut = res.output_versions.index(new)
    assert 0 < cut < NEW_TOKENS
    assert res.output_versions == [old] * cut + [new] * (NEW_TOKENS - cut)
    assert res.interruptions >= 1
    head, tail = res.output_ids[:cut], res.output_ids[cut:]
    want_old = reference_logprobs(old_dir, PROMPT, head, TEMPERATURE)
    want_new = reference_logprobs(new_dir, PROMPT + head, tail, TEMPERATURE)
    assert res.output_logprobs[:cut] == pytest.approx(want_old, abs=1e-4)
    assert res.output_logprobs[cut:] == pytest.approx(want_new, abs=1e-4)
    # The two policies really differ on these tokens (otherwise the check above proves nothing).
    wrong = reference_logprobs(old_dir, PROMPT + head, tail, TEMPERATURE)
    assert max(abs(a - b) for a, b in zip(wrong, want_new, strict=True)) > 1e-2


def served(server) -> tuple[str, int]:
    """The model directory and version the server holds now (the tests below run in one server)."""
    info = server.api.get("/model_info")[1]
    return info["model_path"], int(info["weight_version"])


def test_interrupt_with_update_from_disk(own_server, model_v1):
    old_dir, old = served(own_server)

    def update():
        status, reply = own_server.api.post("/update_weights_from_disk",
                                            {"model_path": str(model_v1), "weight_version": str(old + 1)})
        assert status == 200 and reply["success"], reply

    res = generate_through_update(own_server, update)
    check_segments(res, old_dir, model_v1, old, old + 1)
    assert served(own_server) == (str(model_v1), old + 1)


def test_interrupt_with_update_from_distributed(own_server, tmp_path):
    """The test process plays the trainer's rank 0 and broadcasts new tensors over gloo, joining
    with the shared rendezvous the trainer uses (`services.protocol.weight_group`)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tandem.rollout.tiny_model import init_tiny
    from tandem.services.protocol.weight_group import join_weight_group, leave_weight_group
    old_dir, old = served(own_server)
    new_dir = init_tiny(tmp_path / "v-next", seed=2)
    new = load_file(str(new_dir / "model.safetensors"))
    names = sorted(new)
    port = free_port()
    box = {}
    joiner = threading.Thread(target=lambda: box.setdefault("init", own_server.api.post(
        "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                       "world_size": 2, "group_name": "tandem-test", "backend": "gloo"})))
    joiner.start()
    pg = join_weight_group("127.0.0.1", port, 0, 2, "tandem-test", backend="gloo", timeout_s=60)
    try:
        joiner.join(60)
        assert box["init"][0] == 200 and box["init"][1]["success"], box["init"]

        def update():
            # SGLang 0.5.23 receives distributed weights only inside a weight-update session.
            status, reply = own_server.api.post("/begin_weight_update")
            assert status == 200 and reply["success"], reply
            call = threading.Thread(target=lambda: box.setdefault("update", own_server.api.post(
                "/update_weights_from_distributed",
                {"names": names, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
                 "shapes": [list(new[n].shape) for n in names], "group_name": "tandem-test",
                 "weight_version": str(old + 1)})))
            call.start()
            for n in names:
                dist.broadcast(new[n].contiguous(), src=0, group=pg)
            call.join(60)
            assert box["update"][0] == 200 and box["update"][1]["success"], box["update"]
            status, reply = own_server.api.post("/end_weight_update")
            assert status == 200 and reply["success"], reply

        res = generate_through_update(own_server, update)
        check_segments(res, old_dir, new_dir, old, old + 1)
        status, reply = own_server.api.post("/destroy_weights_update_group", {"group_name": "tandem-test"})
        assert status == 200 and reply["success"]
    finally:
        leave_weight_group(pg)
    assert own_server.api.get("/model_info")[1]["weight_version"] == str(old + 1)


def test_chunks_bound_a_non_interruptible_update_to_one_chunk(own_server, model_v1, tiny_model_dir):
    """`rollout.new_tokens_per_chunk` with `controller.interruptible: false`: the update is sent
    without a pause, so the server applies it once the requests running there finish, which with
    chunks is the end of the current chunk, not of the answer. The sample's versions switch at a
    chunk boundary, and each segment's log-probs are those of the policy that produced it."""
    _, before = served(own_server)
    old_dir, old = tiny_model_dir, before + 1      # a known policy first (earlier tests changed it)
    status, reply = own_server.api.post("/update_weights_from_disk", {"model_path": str(old_dir),
                                                                      "weight_version": str(old)})
    assert status == 200 and reply["success"], reply
    chunk = 16

    async def run():
        async with GenerationClient([ServerRef(own_server.url, own_server.api.api_key)],
                                    chunk_tokens=chunk) as client:
            task = asyncio.ensure_future(client.generate(
                PROMPT, {"max_new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "ignore_eos": True,
                         "sampling_seed": 5}))
            await asyncio.to_thread(wait_for_tokens, own_server.api, 20)
            status, reply = await asyncio.to_thread(own_server.api.post, "/update_weights_from_disk", {
                "model_path": str(model_v1), "weight_version": str(old + 1)})
            assert status == 200 and reply["success"], reply
            return await task, await asyncio.to_thread(lambda: own_server.api.get("/get_server_info")[1])
    res, info = asyncio.run(run())
    cut = res.output_versions.index(old + 1)
    assert cut % chunk == 0 and 0 < cut < NEW_TOKENS, (cut, res.output_versions)
    assert res.interruptions == 0 and res.requests == NEW_TOKENS // chunk
    assert res.output_versions == [old] * cut + [old + 1] * (NEW_TOKENS - cut)
    head, tail = res.output_ids[:cut], res.output_ids[cut:]
    assert res.output_logprobs[:cut] == pytest.approx(reference_logprobs(old_dir, PROMPT, head, TEMPERATURE),
                                                      abs=1e-4)
    assert res.output_logprobs[cut:] == pytest.approx(reference_logprobs(model_v1, PROMPT + head, tail, TEMPERATURE),
                                                      abs=1e-4)
