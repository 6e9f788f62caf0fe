"""JSON bodies need `Content-Type: application/json`, on every route, as on SGLang 0.5.23.

SGLang's `/v1/*` routes check the header themselves (`validate_json_request`: 400 "Unsupported
Media Type"); `/generate` and the weight-update routes take a FastAPI body, which FastAPI reads as
JSON only under `application/json` or `application/*+json` — another type (curl `-d` sends
`application/x-www-form-urlencoded`) and, with FastAPI's default strict content type, none at all
fail the request class's validation, which SGLang answers with 400. A client tested against the
embedded server must not come to rely on anything else. With TANDEM_GEN_URL these requests go to
that server (e.g. a real SGLang), and the same statuses are asserted.
"""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from gen_support import EXTERNAL_URL

GENERATE = {"input_ids": [1, 5, 57], "sampling_params": {"max_new_tokens": 1}}
CHAT = {"messages": [{"role": "user", "content": "2+3"}], "max_tokens": 1}


def send(server, path: str, body: dict, content_type: str | None) -> tuple[int, dict | str]:
    """POST `body` as JSON text under exactly this Content-Type (None: no such header at all)."""
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text) if text else ""
    except ValueError:
        return resp.status, text


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_a_json_content_type_is_read(shared_server, content_type):
    status, out = send(shared_server, "/generate", GENERATE, content_type)
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
@pytest.mark.parametrize(("path", "body"), [("/generate", GENERATE), ("/abort_request", {"rid": "none-such"})])
def test_json_under_another_content_type_is_refused(shared_server, path, body, content_type):
    status, out = send(shared_server, path, body, content_type)
    assert status == 400, out
    if not EXTERNAL_URL:   # the embedded server's message says what to send
        assert "Content-Type: application/json" in out["message"], out


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None])
def test_the_openai_routes_say_unsupported_media_type(shared_server, content_type):
    status, out = send(shared_server, "/v1/chat/completions", CHAT, content_type)
    assert status == 400, out
    assert "Unsupported Media Type: Only 'application/json' is allowed" in json.dumps(out)
