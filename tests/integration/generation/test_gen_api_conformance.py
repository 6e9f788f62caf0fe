"""API conformance: every endpoint's request and reply shapes as SGLang 0.5.x defines them.

Runs against the embedded server; with TANDEM_GEN_URL it runs against any server (e.g. SGLang
on a GPU machine). Prompts are small token ids valid for any vocabulary.
"""
from __future__ import annotations

import threading
import time

PROMPT = [1, 5, 20, 21, 22]


def check_generate_reply(out: dict, prompt_len: int, *, logprobs: bool = True) -> None:
    assert isinstance(out["text"], str)
    assert all(isinstance(t, int) for t in out["output_ids"])
    meta = out["meta_info"]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["prompt_tokens"] == prompt_len
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert isinstance(meta["weight_version"], str)
    if logprobs:
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out["output_ids"]
        assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in lps)


def test_generate_single(shared_server):
    out = shared_server.generate(PROMPT, max_new_tokens=6, temperature=0.8, ignore_eos=True)
    check_generate_reply(out, len(PROMPT))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(out["output_ids"]) == 6


def test_generate_batch_and_text(shared_server):
    status, outs = shared_server.post("/generate", {"input_ids": [PROMPT, PROMPT[:3]],
                                                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                                                    "return_logprob": True})
    assert status == 200 and isinstance(outs, list) and len(outs) == 2
    check_generate_reply(outs[0], len(PROMPT))
    check_generate_reply(outs[1], 3)
    status, out = shared_server.post("/generate", {"text": "12+3=", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
    check_generate_reply(out, out["meta_info"]["prompt_tokens"], logprobs=False)


def test_stop_token_ids_and_text_in_logprobs(shared_server):
    greedy = shared_server.generate(PROMPT, max_new_tokens=12, temperature=0, ignore_eos=True)["output_ids"]
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    status, out = shared_server.post("/generate", {
        "input_ids": PROMPT, "return_logprob": True, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_id]}})
    assert status == 200
    assert out["output_ids"] == greedy[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert all(isinstance(text, str) for _, _, text in out["meta_info"]["output_token_logprobs"])


def wait_running(api, n: int) -> None:
    """Until `n` requests are running (from get_server_info's internal_states when the server
    reports num_running_reqs, as SGLang and the embedded server do; else a fixed pause)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = api.get("/get_server_info")[1].get("internal_states") or [{}]
        if "num_running_reqs" not in states[0]:
            time.sleep(1.0)
            return
        if sum(s.get("num_running_reqs", 0) for s in states) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests never ran together")


def _in_background(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    return t, box


def test_pause_abort_mode_returns_partial_and_holds_new_requests(shared_server):
    long_call = _in_background(lambda: shared_server.generate(PROMPT, max_new_tokens=400, ignore_eos=True))
    wait_running(shared_server, 1)
    status, reply = shared_server.post("/pause_generation", {"mode": "abort"})
    assert status == 200 and reply["status"] == "ok"
    long_call[0].join(30)
    out = long_call[1]["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 400
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    held = _in_background(lambda: shared_server.generate(PROMPT, max_new_tokens=3, ignore_eos=True))
    held[0].join(1.0)
    assert "out" not in held[1], "a request sent while paused must wait for continue_generation"
    status, reply = shared_server.post("/continue_generation")
    assert status == 200 and reply["status"] == "ok"
    held[0].join(30)
    assert held[1]["out"]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_by_rid_and_all(shared_server):
    calls = [_in_background(lambda rid=rid: shared_server.post("/generate", {
        "input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})[1])
        for rid in ("victim-1", "victim-2")]
    wait_running(shared_server, 2)
    status, _ = shared_server.post("/abort_request", {"rid": "victim-1"})
    assert status == 200
    calls[0][0].join(30)
    first = calls[0][1]["out"]
    assert first["meta_info"]["id"] == "victim-1"
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert calls[1][0].is_alive()
    status, _ = shared_server.post("/abort_request", {"abort_all": True})
    assert status == 200
    calls[1][0].join(30)
    assert calls[1][1]["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_update_weights_from_disk_same_model_sets_version(shared_server, tiny_model_dir, embedded_only):
    status, reply = shared_server.post("/update_weights_from_disk",
                                       {"model_path": str(tiny_model_dir), "weight_version": "42"})
    assert status == 200 and reply["success"] is True and "num_paused_requests" in reply
    assert shared_server.get("/get_model_info")[1]["weight_version"] == "42"
    assert shared_server.get("/model_info")[1]["weight_version"] == "42"
    # /server_info reports the start-up arguments: its weight_version does not follow updates.
    assert shared_server.get("/server_info")[1]["weight_version"] != "42"
    assert shared_server.get("/get_weight_version")[0] == 404        # not a route in SGLang 0.5.23
    out = shared_server.generate(PROMPT, max_new_tokens=2)
    assert out["meta_info"]["weight_version"] == "42"
    assert out["meta_info"]["weight_versions"] == [{"version": "42", "start": 0, "end": 2}]
    status, reply = shared_server.post("/update_weights_from_disk", {"model_path": "/nonexistent/model"})
    assert status == 400 and reply["success"] is False
    assert shared_server.get("/get_model_info")[1]["weight_version"] == "42"


def test_info_health_and_cache_endpoints(shared_server):
    assert shared_server.get("/health")[0] == 200
    assert shared_server.get("/health_generate")[0] == 200
    assert shared_server.get("/ready")[0] == 200
    for path in ("/model_info", "/server_info"):
        assert shared_server.get(path)[0] == 200, path
    status, loads = shared_server.get("/v1/loads")
    assert status == 200 and {"timestamp", "version", "accelerator", "num_accelerators", "loads"} <= set(loads)
    assert loads["loads"][0]["dp_rank"] == 0 and "num_running_reqs" in loads["loads"][0]
    status, info = shared_server.get("/get_model_info")
    assert status == 200 and info["is_generation"] is True and "model_path" in info and "weight_version" in info
    status, info = shared_server.get("/get_server_info")
    assert status == 200 and "version" in info and isinstance(info["internal_states"], list)
    assert "api_key" not in info or info["api_key"] in (None, "")
    assert shared_server.get("/flush_cache")[0] == 200
    assert shared_server.post("/flush_cache")[0] == 200


def test_api_key_required(shared_server):
    status, body = shared_server.post("/generate", {"input_ids": PROMPT}, key=None)
    assert status == 401 and body == {"error": "Unauthorized"}
    status, _ = shared_server.get("/get_model_info", key="wrong-key")
    assert status == 401
    assert shared_server.post("/pause_generation", key=None)[0] == 401
    assert shared_server.get("/health", key=None)[0] == 200       # health stays open, as in SGLang


def test_update_without_pause_waits_for_in_flight_requests(shared_server, tiny_model_dir, embedded_only):
    """As in SGLang, an update that does not abort lets running requests finish under the old weights."""
    old = shared_server.get("/model_info")[1]["weight_version"]
    running = _in_background(lambda: shared_server.generate(PROMPT, max_new_tokens=200, ignore_eos=True))
    wait_running(shared_server, 1)
    status, reply = shared_server.post("/update_weights_from_disk",
                                       {"model_path": str(tiny_model_dir), "weight_version": str(int(old) + 1)})
    assert status == 200 and reply["success"], reply
    running[0].join(30)
    out = running[1]["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 200
    assert out["meta_info"]["weight_version"] == old
    assert shared_server.generate(PROMPT, max_new_tokens=1)["meta_info"]["weight_version"] == str(int(old) + 1)


def test_pause_retract_holds_requests_across_an_update(shared_server, tiny_model_dir, embedded_only):
    """retract: running requests are held, not returned; after an update (KV dropped, re-prefilled)
    and continue they finish whole, with spans over both versions."""
    old = int(shared_server.get("/model_info")[1]["weight_version"])
    call = _in_background(lambda: shared_server.generate(PROMPT, max_new_tokens=300, ignore_eos=True))
    wait_running(shared_server, 1)
    assert shared_server.post("/pause_generation", {"mode": "retract"})[0] == 200
    call[0].join(0.5)
    assert "out" not in call[1], "a held request must not return"
    status, reply = shared_server.post("/update_weights_from_disk",
                                       {"model_path": str(tiny_model_dir), "weight_version": str(old + 1)})
    assert status == 200 and reply["success"] and reply["num_paused_requests"] == 0, reply
    assert shared_server.post("/continue_generation")[0] == 200
    call[0].join(30)
    meta = call[1]["out"]["meta_info"]
    assert len(call[1]["out"]["output_ids"]) == 300 and meta["finish_reason"]["type"] == "length"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [str(old), str(old + 1)], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == 300
    assert meta["weight_version"] == str(old + 1)


def test_pause_in_place_update_keeps_the_batch_and_refuses_the_flush(shared_server, tiny_model_dir, embedded_only):
    """in_place (as SGLang 0.5.23): the running batch keeps its KV cache through an update, so the
    update's cache flush is refused: 400, the weights and spans switch version, /model_info's
    version stays. With flush_cache false the same update succeeds."""
    old = int(shared_server.get("/model_info")[1]["weight_version"])
    call = _in_background(lambda: shared_server.generate(PROMPT, max_new_tokens=300, ignore_eos=True))
    wait_running(shared_server, 1)
    assert shared_server.post("/pause_generation", {"mode": "in_place"})[0] == 200
    status, reply = shared_server.post("/update_weights_from_disk",
                                       {"model_path": str(tiny_model_dir), "weight_version": str(old + 1)})
    assert status == 400 and reply["success"] is False and "cache was not flushed" in reply["message"], reply
    assert shared_server.get("/model_info")[1]["weight_version"] == str(old)
    status, reply = shared_server.post("/update_weights_from_disk",
                                       {"model_path": str(tiny_model_dir), "weight_version": str(old + 2),
                                        "flush_cache": False})
    assert status == 200 and reply["success"], reply
    assert shared_server.get("/model_info")[1]["weight_version"] == str(old + 2)
    assert shared_server.post("/continue_generation")[0] == 200
    call[0].join(30)
    meta = call[1]["out"]["meta_info"]
    # Both updates came while the request was held with the same tokens: the middle version
    # produced none of them, so its span is empty and dropped (SGLang's merging rule).
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [str(old), str(old + 2)], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == 300
    assert meta["weight_version"] == str(old + 2)
