"""The embedded server returns the experts each position was routed to (SGLang's
`return_routed_experts`, rollout/server/routed_experts.py): base64 int32 rows (positions, layers,
top_k) over `[routed_experts_start_len, prompt + output - 1)`, the same experts a full forward of
the sequence routes to (its prefill and decode steps route as one forward would), for every
sample of a group sharing one prefill; nothing for a request that did not ask, nor a dense model."""
from __future__ import annotations

import base64
import threading
from types import SimpleNamespace

import megatron_moe_case as mm
import numpy as np
import pytest
import torch

from tandem.rollout.server.engine import Engine, Request
from tandem.rollout.server.requests import parse_generate
from tandem.rollout.server.routed_experts import RoutingCapture
from tandem.rollout.server.sampling import BadRequest, SamplingParams

TOK = SimpleNamespace(eos_token_id=None, decode=lambda ids, **kw: "")
PROMPT = [3, 14, 15, 9, 26, 5, 35]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = mm.moe_model().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def _run(model, reqs):
    done, all_done = [], threading.Event()

    def on_done(reply):
        done.append(reply)
        if len(done) == len(reqs):
            all_done.set()
    for r in reqs:
        r.on_done = on_done
    engine = Engine(model, TOK, model_path="moe", seed=1)
    try:
        engine.submit(reqs).result(timeout=60)
        assert all_done.wait(timeout=60)
    finally:
        engine.stop()
    return {d["meta_info"]["id"]: d for d in done}


def _rows(reply) -> np.ndarray:
    raw = base64.b64decode(reply["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype="<i4").reshape(-1, 2, mm.TOPK)


def _full_forward_routing(model, ids) -> np.ndarray:
    cap = RoutingCapture(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        return cap.take().numpy()
    finally:
        cap.remove()


def _req(rid, start=0, routed=True, n=6):
    return Request(prompt_ids=list(PROMPT), params=SamplingParams(max_new_tokens=n, ignore_eos=True),
                   on_done=None, rid=rid, return_routed_experts=routed, routed_experts_start_len=start)


def test_routed_experts_cover_the_fed_positions_as_one_forward_routes_them(model):
    replies = _run(model, [_req("a"), _req("b"), _req("c", start=len(PROMPT)), _req("d", routed=False)])
    for rid in "abc":
        out = replies[rid]["output_ids"]
        assert len(out) == 6
        full = _full_forward_routing(model, PROMPT + out)[:-1]        # the last token was never fed
        start = len(PROMPT) if rid == "c" else 0
        rows = _rows(replies[rid])
        assert rows.shape == (len(PROMPT) + 6 - 1 - start, 2, mm.TOPK)
        # top-k order may differ only where two experts tie; compare the sets
        assert np.array_equal(np.sort(rows, -1), np.sort(full[start:], -1)), rid
    assert "routed_experts" not in replies["d"]["meta_info"]
    assert replies["a"]["output_ids"] != replies["b"]["output_ids"]     # two samples, one prefill


def test_a_dense_model_has_no_routers_and_returns_no_key(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not RoutingCapture(dense).enabled


def test_request_fields_are_parsed_and_bounded_as_sglang():
    def parse(body):
        return parse_generate(body, tokenizer=TOK, vocab=61, context_len=128, on_done_factory=lambda i: None)[0]
    r, = parse({"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": 7})
    assert (r.return_routed_experts, r.routed_experts_start_len) == (True, 7)
    r, = parse({"input_ids": PROMPT})
    assert (r.return_routed_experts, r.routed_experts_start_len) == (False, 0)
    with pytest.raises(BadRequest, match="routed_experts_start_len=8 is outside"):
        parse({"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": 8})
    with pytest.raises(BadRequest, match="return_routed_experts must be true or false"):
        parse({"input_ids": PROMPT, "return_routed_experts": 1})
