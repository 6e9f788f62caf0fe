"""The embedded server against SGLang 0.5.23's contract: auth levels, weight-update sessions,
/v1/loads, health and readiness while paused. Real HTTP against a real `tandem gen serve`
started with both an API key and an admin key (the launcher's setup), and health probing set
as the launcher sets it for SGLang (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`).
"""

from __future__ import annotations

import threading
import time

import pytest
from gen_support import ServerProcess

API, ADMIN = "api-key-1", "admin-key-2"
PROMPT = [1, 5, 57, 50, 58, 6]
NORMAL_ROUTES = [("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/server_info"),
                 ("GET", "/get_server_info"), ("GET", "/v1/loads")]
# Admin routes called with bodies they accept and that change nothing lasting.
ADMIN_CALLS = [("POST", "/flush_cache", None), ("GET", "/flush_cache", None),
               ("POST", "/abort_request", {"rid": "nothing-has-this-id"}),
               ("POST", "/continue_generation", {}), ("POST", "/update_weight_version",
                                                     {"new_version": "0", "abort_all_requests": False})]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("gen-contract"), api_key=API, admin_key=ADMIN,
                        env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    yield srv
    srv.stop()


def test_auth_levels_over_http(server):
    api = server.api
    status, body = api.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, key=None)
    assert (status, body) == (401, {"error": "Unauthorized"})
    assert api.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, key=API)[0] == 200
    # the admin key does not open NORMAL routes when an API key is set
    assert api.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, key=ADMIN)[0] == 401
    for method, path in NORMAL_ROUTES:
        assert api.call(method, path, key=API)[0] == 200, path
        assert api.call(method, path, key=None)[0] == 401, path
        assert api.call(method, path, key=ADMIN)[0] == 401, path
    for method, path, body in ADMIN_CALLS:
        assert api.call(method, path, body, key=API) == (401, {"error": "Unauthorized"}), path
        assert api.call(method, path, body, key=None)[0] == 401, path
        assert api.call(method, path, body, key=ADMIN)[0] == 200, path
    for path in ("/health", "/health_generate", "/ready"):
        assert api.get(path, key=None)[0] == 200, path
    # a route the server does not have is judged as NORMAL: 401 before 404
    assert api.get("/no_such_route", key=None)[0] == 401
    assert api.get("/no_such_route", key=API)[0] == 404
    assert api.get("/get_weight_version", key=API)[0] == 404       # not a route in SGLang 0.5.23


def test_weight_update_session(server):
    admin = server.admin
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "no-group"}
    status, reply = admin.post("/update_weights_from_distributed", body)
    assert status == 400 and reply == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"}
    status, reply = admin.post("/end_weight_update")
    assert status == 400 and reply["success"] is False and "no weight-update session is open" in reply["message"]
    assert admin.post("/begin_weight_update", {"selector": "all"}) == (200, {"success": True, "message": "Success"})
    status, reply = admin.post("/begin_weight_update")
    assert status == 400 and reply["success"] is False and "already open" in reply["message"]
    # inside the session the route gets past the session check (and fails on the missing group)
    status, reply = admin.post("/update_weights_from_distributed", body)
    assert status == 400 and "no weight update group named 'no-group'" in reply["message"], reply
    assert admin.post("/end_weight_update") == (200, {"success": True, "message": "Success"})
    assert admin.post("/begin_weight_update", {"selector": "nonsense"})[0] == 400
    assert server.api.post("/begin_weight_update", key=API)[0] == 401


def _generate_in_background(api, n_tokens: int) -> tuple[threading.Thread, dict]:
    box: dict = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n_tokens, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.setdefault("out", api.post("/generate", body)))
    t.start()
    return t, box


def _wait_loads(api, pred) -> dict:
    deadline = time.monotonic() + 60
    while True:
        load = api.get("/v1/loads")[1]["loads"][0]
        if pred(load):
            return load
        assert time.monotonic() < deadline, f"load never matched: {load}"
        time.sleep(0.02)


def test_v1_loads(server):
    api = server.api
    status, reply = api.get("/v1/loads")
    assert status == 200 and set(reply) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (load,) = reply["loads"]
    core = {"timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
            "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
            "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
            "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments"}
    assert core <= set(load) and load["dp_rank"] == 0 and "queues" in load
    assert set(api.get("/v1/loads?include=core")[1]["loads"][0]) == core
    assert set(api.get("/v1/loads?include=queues")[1]["loads"][0]) == core | {"queues"}
    assert api.get("/v1/loads?dp_rank=1")[1]["loads"] == []
    assert api.get("/v1/loads?include=bogus")[0] == 400
    assert api.get("/v1/loads?dp_rank=x")[0] == 400
    t, box = _generate_in_background(api, 400)
    load = _wait_loads(api, lambda ld: ld["num_running_reqs"] == 1)
    assert load["num_used_tokens"] > 0 and load["max_running_requests"] >= 1
    status, text = api.get("/v1/loads?format=prometheus")
    assert status == 200 and 'sglang_num_running_reqs{dp_rank="0"}' in text
    t.join(60)
    assert box["out"][0] == 200


def test_health_and_ready_while_paused(server):
    """With generation probing off for /health (as the launcher starts servers), /health answers
    200 while paused; /ready says 503 (not accepting work); /health_generate still probes, and
    its probe waits behind the pause like any request: 503 once SGLANG_HEALTH_CHECK_TIMEOUT passes."""
    api, admin = server.api, server.admin
    assert admin.post("/pause_generation", {"mode": "retract"})[0] == 200
    try:
        assert api.get("/health", key=None)[0] == 200
        assert api.get("/ready", key=None)[0] == 503
        assert api.get("/health_generate", key=None)[0] == 503
    finally:
        assert admin.post("/continue_generation")[0] == 200
    assert api.get("/ready", key=None)[0] == 200
    assert api.get("/health_generate", key=None)[0] == 200
