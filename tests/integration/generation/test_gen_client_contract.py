"""The generation client's reading of SGLang 0.5.23 replies: per-token versions from
`weight_versions` spans (validated), seeds only where the server honours them, and the admin key
for its best-effort `/abort_request`.

Malformed spans and SGLang's `/server_info` cannot come from the embedded server, so part of
this runs against a stand-in HTTP server on a real socket that answers the way SGLang's routes
are shaped (documented here as a stand-in; no GPU server can run on this machine).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tandem.rollout.client import GenerationClient, GenerationError, ServerRef


class StandIn:
    """An SGLang-shaped HTTP stand-in: records what the client sends."""

    def __init__(self, *, deterministic: bool, spans_ok: bool = True, hang: bool = False,
                 aborts: tuple[int, ...] = (), cap: int = 0):
        self.deterministic, self.spans_ok, self.hang = deterministic, spans_ok, hang
        self.cap = cap   # > 0: answer at most this many tokens with finish "length" (a server's own limit)
        self.abort_tokens = list(aborts)   # each call answers "abort" after this many tokens, in turn
        self.payloads: list[dict] = []
        self.aborts: list[tuple[str | None, dict]] = []

    async def generate(self, request):
        body = await request.json()
        self.payloads.append(body)
        if self.hang:
            await asyncio.sleep(30)
        n = body["sampling_params"]["max_new_tokens"]
        if self.cap:
            n = min(n, self.cap)
        finish = {"type": "length", "length": n}
        if self.abort_tokens:
            n, finish = min(n, self.abort_tokens.pop(0)), {"type": "abort", "message": "Abort before update"}
        spans = ([{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": n}] if self.spans_ok and n > 1
                 else [{"version": "5", "start": 0, "end": n}] if self.spans_ok
                 else [{"version": "5", "start": 0, "end": n - 1}])
        return web.json_response({"text": "", "output_ids": list(range(n)), "meta_info": {
            "id": body["rid"], "finish_reason": finish, "weight_version": "5",
            "weight_versions": spans, "output_token_logprobs": [[-1.0, i, None] for i in range(n)]}})

    async def server_info(self, request):
        return web.json_response({"version": "0.5.23", "enable_deterministic_inference": self.deterministic})

    async def abort(self, request):
        self.aborts.append((request.headers.get("Authorization"), await request.json()))
        return web.Response(status=200)

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/abort_request", self.abort)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def test_client_stamps_versions_from_spans_and_drops_ignored_seeds():
    async def run():
        async with StandIn(deterministic=False) as s, GenerationClient([ServerRef(s.url, "k")]) as client:
            res = await client.generate([1, 2], {"max_new_tokens": 4, "sampling_seed": 9})
            return s, res
    s, res = asyncio.run(run())
    assert res.output_versions == [4, 5, 5, 5] and res.requests == 1
    assert "sampling_seed" not in s.payloads[0]["sampling_params"] and res.seeded is False


def test_client_keeps_seeds_on_deterministic_sglang():
    async def run():
        async with StandIn(deterministic=True) as s, GenerationClient([ServerRef(s.url, "k")]) as client:
            res = await client.generate([1, 2], {"max_new_tokens": 3, "sampling_seed": 9})
            return s, res
    s, res = asyncio.run(run())
    assert s.payloads[0]["sampling_params"]["sampling_seed"] == 9 and res.seeded is True


def test_client_rejects_spans_that_do_not_cover_the_tokens():
    async def run():
        async with StandIn(deterministic=False, spans_ok=False) as s, \
                GenerationClient([ServerRef(s.url, "k")]) as client:
            await client.generate([1, 2], {"max_new_tokens": 4})
    with pytest.raises(GenerationError, match="cover 3 tokens but the reply has 4"):
        asyncio.run(run())


@pytest.mark.parametrize("ref, want", [(ServerRef("", "k", admin_api_key="adm"), "Bearer adm"),
                                       (ServerRef("", "k"), "Bearer k")])
def test_abort_after_timeout_uses_the_admin_key(ref, want):
    async def run():
        async with StandIn(deterministic=False, hang=True) as s:
            async with GenerationClient([ServerRef(s.url, ref.api_key, ref.admin_api_key)], timeout_s=0.3,
                                        max_failovers=0, retry_delay_s=0.01) as client:
                with pytest.raises(GenerationError):
                    await client.generate([1, 2], {"max_new_tokens": 4})
            return s
    s = asyncio.run(run())
    assert len(s.aborts) == 1
    header, body = s.aborts[0]
    assert header == want and body == {"rid": s.payloads[0]["rid"]}


def test_interruptions_with_progress_never_exhaust_the_retry_limit():
    """The limit counts aborts in a row that brought no new token (a server stuck aborting); an
    update every few tokens on a long answer is progress, however many times it happens."""
    async def run(aborts):
        async with StandIn(deterministic=False, aborts=aborts) as s, \
                GenerationClient([ServerRef(s.url, "k")], max_interruptions=2) as client:
            return await client.generate([1, 2], {"max_new_tokens": 8})
    res = asyncio.run(run((1, 1, 1, 1, 1)))
    assert (len(res.output_ids), res.interruptions, res.finish_reason) == (8, 5, "length")
    with pytest.raises(GenerationError, match="aborted 3 times in a row without a new token"):
        asyncio.run(run((1, 0, 0, 0)))



def test_chunks_resubmit_until_the_budget_and_a_shorter_length_reply_ends_the_answer():
    """`chunk_tokens` (rollout.new_tokens_per_chunk): each request asks for at most a chunk and
    the next one carries prompt + tokens so far; a chunk ending is not an interruption. A
    "length" reply with fewer tokens than asked is the server's own limit: the answer ends."""
    async def run(cap=0, chunk=3):
        async with StandIn(deterministic=False, cap=cap) as s, \
                GenerationClient([ServerRef(s.url, "k")], chunk_tokens=chunk) as client:
            return s, await client.generate([1, 2], {"max_new_tokens": 8})
    s, res = asyncio.run(run())
    assert [p["sampling_params"]["max_new_tokens"] for p in s.payloads] == [3, 3, 2]
    assert [p["input_ids"] for p in s.payloads] == [[1, 2], [1, 2, 0, 1, 2], [1, 2, 0, 1, 2, 0, 1, 2]]
    assert (len(res.output_ids), res.requests, res.interruptions, res.finish_reason) == (8, 3, 0, "length")
    s, res = asyncio.run(run(cap=2))
    assert (len(res.output_ids), res.requests, res.finish_reason) == (2, 1, "length")
    s, res = asyncio.run(run(chunk=0))
    assert [p["sampling_params"]["max_new_tokens"] for p in s.payloads] == [8] and res.requests == 1
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        GenerationClient([ServerRef(s.url, "k")], chunk_tokens=-1)
