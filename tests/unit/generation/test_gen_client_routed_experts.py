"""The generation client's routed experts (routing replay), without a server: each request asks
from the positions already covered, an interrupted sample's segments join into one array of
[prompt + output - 1, layers, top_k], and a reply without them, or with the wrong number of
positions, fails the sample naming why (SGLang without --enable-return-routed-experts answers
with no key at all)."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from tandem.rollout.client.generate import GenerationClient, GenerationError, decode_routed_experts

LAYERS, TOPK = 3, 2
PROMPT = [5, 6, 7, 8]


def _routing(position: int) -> list[list[int]]:
    """The expert ids a fake server gives `position` (distinct per position and layer)."""
    return [[(position + layer) % 8, (position + layer + 1) % 8] for layer in range(LAYERS)]


class FakeServer:
    """Scripted replies in SGLang 0.5.23's shape; `drop_key` / `extra_rows` break them."""

    def __init__(self, script: list[tuple[str, int]], drop_key: bool = False, extra_rows: int = 0):
        self.script, self.drop_key, self.extra_rows = list(script), drop_key, extra_rows
        self.payloads: list[dict] = []

    async def __call__(self, server, payload: dict):
        self.payloads.append(payload)
        kind, n = self.script.pop(0)
        fed = payload["input_ids"]
        ids = [10 + len(fed) + i for i in range(n)]
        start = payload.get("routed_experts_start_len", 0)
        rows = [_routing(p) for p in range(start, len(fed) + n - 1 + self.extra_rows)]
        meta = {"id": payload["rid"], "weight_version": "0", "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "finish_reason": {"type": kind, **({"length": n} if kind == "length" else {})}}
        if not self.drop_key:
            meta["routed_experts"] = base64.b64encode(np.asarray(rows, "<i4").tobytes()).decode()
        return {"text": "", "output_ids": ids, "meta_info": meta}


def _generate(server: FakeServer, max_new: int = 8):
    client = GenerationClient(["http://fake"], seed_mode="ignored", routed_experts=(LAYERS, TOPK))
    client._post = server
    return asyncio.run(client.generate(PROMPT, {"max_new_tokens": max_new}))


def test_segments_of_an_interrupted_sample_join_exactly():
    server = FakeServer([("abort", 3), ("abort", 0), ("length", 5)])
    res = _generate(server)
    assert [p["routed_experts_start_len"] for p in server.payloads] == [0, 6, 6]
    assert all(p["return_routed_experts"] is True for p in server.payloads)
    experts = res.routed_experts
    assert experts.shape == (len(PROMPT) + 8 - 1, LAYERS, TOPK)
    assert np.array_equal(experts, np.asarray([_routing(p) for p in range(len(PROMPT) + 8 - 1)]))


def test_a_reply_without_experts_or_with_other_positions_fails_the_sample():
    with pytest.raises(GenerationError, match="--enable-return-routed-experts"):
        _generate(FakeServer([("length", 8)], drop_key=True))
    with pytest.raises(GenerationError, match="routed_experts has 12 positions, expected 11"):
        _generate(FakeServer([("length", 8)], extra_rows=1))


def test_decode_checks_the_encoding():
    assert decode_routed_experts("", LAYERS, TOPK).shape == (0, LAYERS, TOPK)
    with pytest.raises(ValueError, match="do not fill int32 rows"):
        decode_routed_experts(base64.b64encode(bytes(4 * 5)).decode(), LAYERS, TOPK)
    with pytest.raises(ValueError, match="not base64"):
        decode_routed_experts("@@@", LAYERS, TOPK)


def test_without_replay_nothing_is_asked():
    client = GenerationClient(["http://fake"], seed_mode="ignored")
    server = FakeServer([("length", 4)])
    client._post = server
    res = asyncio.run(client.generate(PROMPT, {"max_new_tokens": 4}))
    assert "return_routed_experts" not in server.payloads[0] and res.routed_experts is None
