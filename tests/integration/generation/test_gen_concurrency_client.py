"""Continuous batching seen from outside, and the client's failure handling."""
from __future__ import annotations

import asyncio
import socket

import pytest

from tandem.rollout.client import GenerationClient, GenerationError, ServerRef
from tandem.services.protocol import free_port

PROMPT = [1, 6, 57, 50, 58]


def test_mixed_lengths_all_complete_and_short_ones_first(shared_server):
    lengths = [4, 200, 6, 150, 5, 180, 8, 3, 160, 7, 4, 190]
    finished: list[int] = []

    async def run():
        async with GenerationClient([ServerRef(shared_server.url, shared_server.api_key)]) as client:
            async def one(i, n):
                res = await client.generate(PROMPT + [10 + i], {"max_new_tokens": n, "ignore_eos": True,
                                                                "temperature": 1.0})
                finished.append(i)
                return res
            return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    results = asyncio.run(run())
    for res, n in zip(results, lengths, strict=True):
        assert len(res.output_ids) == n == len(res.output_logprobs) == len(res.output_versions)
        assert res.finish_reason == "length"
    short = {i for i, n in enumerate(lengths) if n <= 8}
    long = {i for i, n in enumerate(lengths) if n >= 150}
    last_short = max(finished.index(i) for i in short)
    first_long = min(finished.index(i) for i in long)
    assert last_short < first_long, f"short requests waited for long ones: order {finished}"


def test_decoding_is_batched(shared_server, embedded_only):
    """12 concurrent 60-token requests take far fewer engine steps than 12 x 60 tokens."""
    before = shared_server.get("/get_server_info")[1]["internal_states"][0]

    async def run():
        async with GenerationClient([ServerRef(shared_server.url, shared_server.api_key)]) as client:
            await asyncio.gather(*(client.generate(PROMPT, {"max_new_tokens": 60, "ignore_eos": True})
                                   for _ in range(12)))
    asyncio.run(run())
    after = shared_server.get("/get_server_info")[1]["internal_states"][0]
    tokens = after["generated_tokens"] - before["generated_tokens"]
    steps = after["steps"] - before["steps"]
    assert tokens >= 12 * 60
    assert steps < tokens / 3, (steps, tokens)


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_client_fails_over_to_a_live_server(shared_server):
    dead = _dead_url()
    picks = []

    def picker(key, exclude):
        choice = dead if dead not in exclude else shared_server.url
        picks.append(choice)
        return ServerRef(choice, shared_server.api_key)

    async def run():
        async with GenerationClient(picker, retry_delay_s=0.01) as client:
            return await client.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True})
    res = asyncio.run(run())
    assert len(res.output_ids) == 5 and res.failovers == 1 and picks == [dead, shared_server.url]


def test_client_raises_on_bad_request_and_dead_servers(shared_server):
    async def bad():
        async with GenerationClient([ServerRef(shared_server.url, shared_server.api_key)]) as client:
            await client.generate(PROMPT, {"max_new_tokens": 5, "no_such_param": 1})
    with pytest.raises(GenerationError, match="400"):
        asyncio.run(bad())

    async def dead():
        async with GenerationClient([_dead_url()], max_failovers=2, retry_delay_s=0.01) as client:
            await client.generate(PROMPT, {"max_new_tokens": 5})
    with pytest.raises(GenerationError, match="3 servers"):
        asyncio.run(dead())

    async def unauthorised():
        async with GenerationClient([ServerRef(shared_server.url, "wrong")]) as client:
            await client.generate(PROMPT, {"max_new_tokens": 5})
    with pytest.raises(GenerationError, match="401"):
        asyncio.run(unauthorised())


def test_client_timeouts_are_bounded():
    """A server that accepts connections but never answers: the client gives up, it does not hang."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"

    async def run():
        async with GenerationClient([url], timeout_s=0.3, max_failovers=1, retry_delay_s=0.01) as client:
            await client.generate(PROMPT, {"max_new_tokens": 5})
    try:
        with pytest.raises(GenerationError, match="2 servers"):
            asyncio.run(run())
    finally:
        silent.close()


def test_group_samples_share_one_prefill(shared_server, embedded_only):
    """n samples of one prompt (a GRPO group) are prefilled once and still sample independently."""
    prompt = PROMPT + [77, 78, 79]
    before = shared_server.get("/get_server_info")[1]["internal_states"][0]["prefill_tokens"]
    status, outs = shared_server.post("/generate", {"input_ids": prompt, "return_logprob": True,
                                                    "sampling_params": {"n": 8, "max_new_tokens": 30,
                                                                        "ignore_eos": True}})
    assert status == 200 and len(outs) == 8
    after = shared_server.get("/get_server_info")[1]["internal_states"][0]["prefill_tokens"]
    assert after - before == len(prompt)
    assert len({tuple(o["output_ids"]) for o in outs}) == 8
