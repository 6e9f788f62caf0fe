"""The OpenAI-compatible routes driven by the official `openai` client over real HTTP.

What a user's evaluation harness or agent relies on: `/v1/models` names the served model, a
completion and a chat completion come back in the client's types, the chat route applies the
model's own chat template (the prompt is exactly the tokenizer's), streamed chunks join to the
non-streamed text, stop strings cut the text (also while streaming: no piece of the stop string
is ever sent), the API key is enforced, a field the server cannot honour is a 400 naming it, and
the requests go through the same engine as `/generate` (same greedy tokens and log-probs, held
by a pause, stopped when the client leaves). The shared server (tiny model, API key) serves them.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.timeout(300)
QUESTION = "What is 12+30?"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(shared_server):
    with openai.OpenAI(base_url=shared_server.url + "/v1", api_key=shared_server.api_key, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy_text(shared_server, ids: list[int], max_new_tokens: int) -> dict:
    status, out = shared_server.post("/generate", {"input_ids": ids, "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                       "temperature": 0}})
    assert status == 200, out
    return out


def test_models_names_the_served_model(client, shared_server):
    models = client.models.list().data
    status, info = shared_server.get("/model_info")
    assert status == 200
    assert [m.id for m in models] == [info["served_model_name"]]
    assert models[0].object == "model" and models[0].owned_by == "sglang"
    assert models[0].model_extra["max_model_len"] == shared_server.get("/server_info")[1]["context_length"]


def test_completion_is_the_engines_greedy_answer(client, shared_server, tokenizer, embedded_only):
    ids = tokenizer.encode("Question: 12+30=")
    ref = greedy_text(shared_server, ids, 12)
    for prompt in ("Question: 12+30=", ids):          # text, and token ids
        r = client.completions.create(model="anything", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
        assert r.object == "text_completion" and r.model == "anything"      # the request's name, echoed
        (choice,) = r.choices
        assert choice.text == ref["text"]
        assert choice.finish_reason == ref["meta_info"]["finish_reason"]["type"]
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref["output_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-5)
        assert r.model_extra["metadata"]["weight_version"] == ref["meta_info"]["weight_version"]
    batch = client.completions.create(model="m", prompt=["12+30=", "7*6="], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(tokenizer.encode("12+30=")) + len(tokenizer.encode("7*6="))


def test_chat_prompt_is_the_models_chat_template(client, shared_server, tokenizer, embedded_only):
    template = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    template = list(template if isinstance(template, list) else template["input_ids"])
    ref = greedy_text(shared_server, template, 16)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                       extra_body={"return_prompt_token_ids": True})
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.model_extra["prompt_token_ids"] == template
    assert r.usage.prompt_tokens == len(template)
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    # Text content parts are the same prompt as a string; max_completion_tokens wins over max_tokens.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    again = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=16, max_tokens=3,
                                           temperature=0)
    assert again.choices[0].message.content == ref["text"]


def _joined(stream, chat: bool) -> tuple[str, list, list]:
    text, reasons, chunks = [], [], []
    for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            piece = c.delta.content if chat else c.text
            text.append(piece or "")
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    return "".join(text), reasons, chunks


def test_streams_join_to_the_unstreamed_greedy_text(client):
    whole = client.completions.create(model="m", prompt="12+30=", max_tokens=20, temperature=0)
    text, reasons, chunks = _joined(client.completions.create(model="m", prompt="12+30=", max_tokens=20,
                                                              temperature=0, stream=True), chat=False)
    assert text == whole.choices[0].text and reasons == [whole.choices[0].finish_reason]
    assert len(chunks) > 2 and {c.object for c in chunks} == {"text_completion"}
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0)
    text, reasons, chunks = _joined(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=True)
    assert text == whole.choices[0].message.content and reasons == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant" and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_a_stream_ends_with_done(shared_server):
    req = urllib.request.Request(shared_server.url + "/v1/chat/completions", method="POST", data=json.dumps({
        "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {shared_server.api_key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = resp.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2]), events


def _stop_case(client) -> tuple[int, str, str]:
    """A seeded sample with two printable ASCII characters at their first occurrence: (seed,
    the sample's text, those characters)."""
    for seed in range(20):
        full = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
        for i in range(2, len(full) - 2):
            stop = full[i:i + 2]
            if all(c.isascii() and c.isprintable() for c in stop) and full.find(stop) == i:
                return seed, full, stop
    pytest.fail("no seeded sample with a usable stop string")


def test_stop_strings_cut_the_text_streamed_or_not(client, embedded_only):
    seed, full, stop = _stop_case(client)
    kw = {"model": "m", "messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": seed,
          "extra_body": {"ignore_eos": True}}
    cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert cut.message.content == full[:full.find(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["matched_stop"] == stop
    # Streaming: the stop string's first character must not have been sent before the second came.
    text, reasons, _ = _joined(client.chat.completions.create(stop=stop, stream=True, **kw), chat=True)
    assert text == cut.message.content and reasons == ["stop"]
    # no_stop_trim keeps the matched string.
    kept = client.chat.completions.create(stop=stop, **{**kw, "extra_body": {"ignore_eos": True, "no_stop_trim": True}})
    assert kept.choices[0].message.content == full[:full.find(stop) + len(stop)]


def test_n_samples_differ_and_share_the_prompt_count(client, embedded_only):
    r = client.chat.completions.create(model="m", messages=MESSAGES, n=3, max_tokens=12, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    one = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.choices[0].message.content == one.choices[0].message.content    # sample j draws from seed + j


def test_the_api_key_is_required(shared_server):
    if not shared_server.api_key:
        pytest.skip("the server has no API key")
    for key in ("wrong-key", "-"):
        with openai.OpenAI(base_url=shared_server.url + "/v1", api_key=key, max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("kwargs, needle", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"messages": []}, "Messages cannot be empty"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"max_tokens": 10_000}, "max_completion_tokens is too large"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, "context length"),
])
def test_bad_chat_requests_are_400_naming_the_field(client, kwargs, needle, embedded_only):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400 and needle in str(err.value)
    reply = err.value.body
    assert reply["object"] == "error" and reply["code"] == 400 and needle in reply["message"], reply
    assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices   # still serving


def test_bad_completion_requests_and_ignored_fields(client, shared_server, embedded_only):
    for kwargs, needle in (({"prompt": ""}, "Prompt cannot be empty"), ({"max_tokens": 0}, "max_tokens"),
                           ({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"),
                           ({"prompt": [1, 10**9]}, "vocabulary")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{"model": "m", "prompt": "1+1=", "max_tokens": 2, **kwargs})
        assert needle in err.value.body["message"], err.value.body
    # Fields the release ignores (not in its request model, or read without effect) pass.
    r = client.completions.create(model="m", prompt="1+1=", max_tokens=2, user="me", best_of=1,
                                  extra_body={"no_such_field": 1})
    assert r.choices[0].text is not None
    status, reply = shared_server.call("POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "malformed JSON" in reply["message"]


def test_a_paused_server_holds_openai_requests(client, shared_server, embedded_only):
    assert shared_server.post("/pause_generation", {"mode": "abort"})[0] == 200
    out = {}
    t = threading.Thread(target=lambda: out.update(r=client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, temperature=0)))
    try:
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), "the request was answered while generation was paused"
    finally:
        assert shared_server.post("/continue_generation")[0] == 200
    t.join(60)
    assert out["r"].choices[0].finish_reason in ("stop", "length")


def test_a_client_leaving_a_stream_stops_its_generation(client, shared_server, embedded_only):
    aborted = shared_server.get("/server_info")[1]["internal_states"][0]["aborted"]
    stream = client.completions.create(model="m", prompt="1+1=", max_tokens=480, temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = shared_server.get("/server_info")[1]["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            break
        time.sleep(0.1)
    assert state["aborted"] == aborted + 1, f"the abandoned stream was not aborted: {state}"
