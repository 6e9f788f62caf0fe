"""The embedded server's OpenAI-compatible replies against the pinned release's own models.

A real `tandem gen serve` (tiny model, both keys) answers `/v1/models`, completions and chat
completions — plain and streamed, with the optional parts a client can ask for (log-probs, token
ids, meta info, usage in the stream, n samples, a stop string) — and a bad request. Every reply
and every streamed chunk goes to `sglang_openai_oracle.py`, which decodes it with the class the
release builds it from (`protocol.py`, `sse_utils.py` from the wheel) and writes it back as the
release writes it: the JSON must come back unchanged. The request bodies themselves must be
bodies the release accepts: they validate against its `CompletionRequest` /
`ChatCompletionRequest` (so the test does not bless a field the release does not have).
"""
from __future__ import annotations

import json
import urllib.request

import pytest
from test_embedded_server_contract import API_KEY, EmbeddedServer

pytestmark = pytest.mark.timeout(600)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = EmbeddedServer(tiny_model_dir, tmp_path_factory.mktemp("openai-contract"))
    yield s
    s.stop()


def ask(wheel, payload: dict) -> dict:
    return wheel.run("sglang_openai_oracle", payload=payload)


def post(server, path: str, body: dict) -> tuple[int, object]:
    """The reply: a JSON object, or for a stream the list of its `data:` payloads."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    if not body.get("stream") or status != 200:
        return status, json.loads(text)
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert all(e.startswith("data: ") for e in events), events
    return status, [json.loads(e[len("data: "):]) for e in events[:-1]]


COMPLETIONS = [
    {"model": "m", "prompt": "12+30=", "max_tokens": 6, "temperature": 0},
    {"model": "m", "prompt": [[1, 5, 57], [1, 5, 58, 50]], "max_tokens": 4, "n": 2, "seed": 3, "logprobs": 0,
     "return_token_ids": True, "stop": ["\n"], "user": "u"},
]
CHATS = [
    {"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0},
    {"model": "m", "messages": MESSAGES, "max_completion_tokens": 5, "n": 2, "seed": 1, "logprobs": True,
     "return_prompt_token_ids": True, "return_token_ids": True, "return_meta_info": True, "top_k": 5,
     "stop": "zz", "chat_template_kwargs": {"enable_thinking": False}},
]


def test_openai_replies_are_the_releases_shapes(server, sglang_wheel):
    replies, bodies = [], []
    with urllib.request.urlopen(urllib.request.Request(server.url + "/v1/models",
                                                       headers={"Authorization": f"Bearer {API_KEY}"})) as r:
        replies.append(("GET /v1/models", "models", json.loads(r.read())))
    for path, kind, requests in (("/v1/completions", "completion", COMPLETIONS), ("/v1/chat/completions", "chat", CHATS)):
        for body in requests:
            bodies.append((path, body))
            status, reply = post(server, path, body)
            assert status == 200, reply
            replies.append((f"POST {path}", kind, reply))
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}}
            for key in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if kind == "chat":      # not with streaming on the chat route (a 400, as in the release)
                    streamed.pop(key, None)
            bodies.append((path, streamed))
            status, chunks = post(server, path, streamed)
            assert status == 200, chunks
            assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
            for c in chunks[:-1]:
                replies.append((f"POST {path} (stream)", f"{kind}_chunk", c))
            replies.append((f"POST {path} (stream, usage)", f"{kind}_usage_chunk", chunks[-1]))
    status, error = post(server, "/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 1.0})
    assert status == 400
    replies.append(("POST /v1/chat/completions (400)", "error", error))
    kinds = {k for _, k, _ in replies}
    assert kinds == {"models", "completion", "chat", "completion_chunk", "completion_usage_chunk", "chat_chunk",
                     "chat_usage_chunk", "error"}, kinds

    verdicts = ask(sglang_wheel, {"replies": [{"kind": k, "reply": r} for _, k, r in replies]})["verdicts"]
    problems = [f"{where} ({kind}): {p}" for (where, kind, _), ps in zip(replies, verdicts, strict=True) for p in ps]
    assert not problems, (f"embedded OpenAI replies vs {sglang_wheel.name} (protocol.py / sse_utils.py):\n  "
                          + "\n  ".join(problems))

    # The requests this test sent are ones the release accepts, field by field.
    calls = [{"method": "POST", "path": p, "body": b, "content_type": "application/json",
              "authorization": f"Bearer {API_KEY}", "deployment": "api key"} for p, b in bodies]
    answer = sglang_wheel.ask("check-calls", {"deployments": {"api key": {"api_key": API_KEY}}, "calls": calls})
    problems = [f"{c['path']} {json.dumps(c['body'])[:120]}: {p}" for c, v in zip(calls, answer["calls"], strict=True)
                for p in v["problems"]]
    assert not problems, "\n  ".join(problems)


def test_a_reply_the_release_would_not_write_is_caught(sglang_wheel):
    """The oracle itself: it must see a stray key, a missing key and a wrong literal."""
    good = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"reasoning_content": None, "content": "a"}, "logprobs": None,
                         "finish_reason": None, "matched_stop": None}]}
    stray = {**good, "extra": 1}
    missing = {k: v for k, v in good.items() if k != "created"}
    usage = {"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1, "prompt_tokens_details": None,
                       "reasoning_tokens": 0, "completion_tokens_details": None}}
    bad_reason = {"id": "x", "object": "text_completion", "created": 1, "model": "m", "usage": usage["usage"],
                  "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "done", "matched_stop": None}]}
    verdicts = ask(sglang_wheel, {"replies": [
        {"kind": "chat_chunk", "reply": good}, {"kind": "chat_chunk", "reply": stray},
        {"kind": "chat_chunk", "reply": missing}, {"kind": "completion_usage_chunk", "reply": usage},
        {"kind": "completion", "reply": bad_reason}]})["verdicts"]
    assert verdicts[0] == [], verdicts[0]
    assert any("extra" in p for p in verdicts[1]), verdicts[1]
    assert verdicts[2], verdicts[2]
    assert any("prompt_tokens_details" in p for p in verdicts[3]), verdicts[3]   # exclude_none drops it
    assert verdicts[4], verdicts[4]


def test_every_request_field_of_the_release_is_decided(sglang_wheel):
    """Each field of the release's request models is honoured, accepted only at its neutral value,
    or ignored, on purpose: a field a new release adds, or a name misspelt here (which would
    silently fall among the fields the release drops), fails naming it."""
    from tandem.rollout.server.openai_requests import CHAT, COMPLETIONS, HANDLED, IGNORED, NEUTRAL

    fields = ask(sglang_wheel, {"request_fields": ["CompletionRequest", "ChatCompletionRequest"]})["request_fields"]
    problems = []
    for route, cls in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        release = set(fields[cls])
        groups = {"HANDLED": HANDLED[route], "NEUTRAL": set(NEUTRAL[route]), "IGNORED": IGNORED[route]}
        decided = set().union(*groups.values())
        problems += [f"{route}: {cls}.{f} is neither handled, neutral-only nor ignored "
                     f"(rollout/server/openai_requests.py)" for f in sorted(release - decided)]
        problems += [f"{route}: {name} lists `{f}`, not a field of {cls}" for name, group in groups.items()
                     for f in sorted(group - release)]
        both = [(a, b, f) for a in groups for b in groups if a < b for f in sorted(groups[a] & groups[b])]
        problems += [f"{route}: `{f}` is in both {a} and {b}" for a, b, f in both]
    assert not problems, f"request fields vs {sglang_wheel.name}:\n  " + "\n  ".join(problems)
