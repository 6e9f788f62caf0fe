"""Malformed input gets a 400 naming the problem, and the server keeps serving."""
from __future__ import annotations

import pytest

PROMPT = [1, 5, 20, 21]


@pytest.mark.parametrize("body, needle", [
    ({"input_ids": "1 2 3"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"input_ids": [1, 10**9]}, "vocabulary"),
    ({"input_ids": PROMPT, "text": "x"}, "exactly one"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    # JSON's NaN / Infinity tokens (json.dumps writes them): refused, never sampled with
    ({"input_ids": PROMPT, "sampling_params": {"temperature": float("nan")}}, "temperature must be a finite number"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": float("inf")}}, "top_p must be a finite number"),
    ({"input_ids": PROMPT, "sampling_params": {"no_such_param": 1}}, "no_such_param"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids"),
    ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": PROMPT, "stream": True}, "stream"),
    ({"input_ids": PROMPT, "bogus": 1}, "bogus"),
    ({"input_ids": [1] * 600}, "context length"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600}}, "context length"),
    # Refused before tokenizing (once, 20 MB of text held the event loop for 35 s).
    ({"text": "a" * 2_000_000}, "cannot fit the context of 512 tokens"),
    ({"text": ["ok", "b" * 40_000]}, "/generate.text[1]"),
    # Bounded before anything is queued (n = 100,000 once queued 82,080 requests for minutes).
    ({"input_ids": PROMPT, "sampling_params": {"n": 1025}}, "1 prompt(s) x n=1025 sequences; at most 1024"),
    ({"input_ids": [PROMPT] * 3, "sampling_params": {"n": 400}}, "3 prompt(s) x n=400 sequences"),
])
def test_generate_rejects(shared_server, embedded_only, body, needle):
    status, reply = shared_server.post("/generate", body)
    assert status == 400, reply
    assert needle in reply["message"]


def test_malformed_bodies_on_every_post_endpoint(shared_server, embedded_only):
    for path in ("/generate", "/update_weights_from_disk", "/init_weights_update_group",
                 "/update_weights_from_distributed", "/abort_request", "/pause_generation"):
        status, reply = shared_server.call("POST", path, raw=b"{not json")
        assert status == 400, (path, reply)
        assert "malformed JSON" in reply["message"]
    status, reply = shared_server.post("/update_weights_from_disk", {"model_path": 7})
    assert status == 400 and "model_path" in reply["message"]
    status, reply = shared_server.post("/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and "master_port" in reply["message"]
    status, reply = shared_server.post("/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in reply["message"]
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "never-created"}
    status, reply = shared_server.post("/update_weights_from_distributed", body)
    assert status == 400 and reply["success"] is False and "begin_weight_update()" in reply["message"]
    assert shared_server.post("/begin_weight_update")[0] == 200
    try:
        status, reply = shared_server.post("/update_weights_from_distributed", body)
    finally:
        assert shared_server.post("/end_weight_update")[0] == 200
    assert status == 400 and reply["success"] is False and "never-created" in reply["message"]
    # Still serving normally.
    out = shared_server.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert len(out["output_ids"]) == 3


def test_a_client_leaving_mid_body_is_one_line_in_the_log(shared_process, shared_server, embedded_only):
    """A body cut short (the client disconnected) is not an internal error with a traceback."""
    import os
    import socket
    import time
    from urllib.parse import urlparse

    url = urlparse(shared_process.url)
    start = os.path.getsize(shared_process.log)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + shared_process.api.api_key.encode() +
                  b"\r\nContent-Length: 100000\r\n\r\n{\"input_ids\": [1, ")
    out = shared_server.generate(PROMPT, max_new_tokens=2, ignore_eos=True)   # still serving
    assert len(out["output_ids"]) == 2
    deadline = time.monotonic() + 10
    while "client went away" not in (log := shared_process.log.read_text()[start:]):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.1)
    assert "Traceback" not in log and "/generate failed" not in log, log[-3000:]


def test_a_client_that_hangs_up_stops_its_work(shared_process, shared_server, embedded_only):
    """As SGLang aborts a request whose client has disconnected (within its 4 s wait), so does the
    embedded server: 256 samples of 400 tokens each are abandoned by their client at once, and the
    server stops well short of generating them all (aiohttp cancels no handler by itself: the work
    once went on for a client long gone)."""
    import json
    import socket
    import time
    from urllib.parse import urlparse

    def state() -> dict:
        return shared_server.call("GET", "/server_info")[1]["internal_states"][0]

    before = state()["generated_tokens"]
    url = urlparse(shared_process.url)
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"n": 256, "max_new_tokens": 400,
                                                                "ignore_eos": True}}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                  + shared_process.api.api_key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while state()["num_running_reqs"] == 0:   # it has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 120
    while (now := state())["num_running_reqs"] or now["num_waiting_reqs"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    generated = now["generated_tokens"] - before
    assert generated < 256 * 400 // 2, generated   # aborted, not run to the end
    out = shared_server.generate(PROMPT, max_new_tokens=2, ignore_eos=True)   # and still serving
    assert len(out["output_ids"]) == 2
