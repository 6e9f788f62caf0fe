"""OpenAI request bodies into engine work (`rollout.server.openai_requests`), called directly.

The rules the release sets and a harness relies on: which sampling values a chat request gets
when it sends none (the model's generation_config, then OpenAI's), how max tokens default and
are bounded, that n seeded samples differ, how a final assistant message is treated, and that a
field the server cannot honour is refused by name while one the release ignores passes. Over
HTTP with the `openai` client: tests/integration/generation/test_gen_openai.py.
"""
from __future__ import annotations

import pytest

from tandem.rollout.server.openai_requests import OpenAIBadRequest, parse_chat, parse_completion

CTX = 512
USER = [{"role": "user", "content": "2+3?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat(tok, defaults=None, **body):
    return parse_chat({"messages": USER, **body}, tokenizer=tok, vocab=len(tok), context_len=CTX,
                      served_name="/models/tiny", defaults=defaults or {})


def completion(tok, **body):
    return parse_completion({"prompt": "2+3=", **body}, tokenizer=tok, vocab=len(tok), context_len=CTX,
                            served_name="/models/tiny")


def test_chat_sampling_defaults_come_from_the_model_then_openai(tok):
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    p = chat(tok, model).params
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    p = chat(tok, model, temperature=0, top_k=None).params          # a value sent wins; null is unset
    assert (p.temperature, p.top_k) == (0.0, 20)
    p = chat(tok).params
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)
    p = completion(tok).params                                       # completions: OpenAI's, always
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (1.0, 1.0, -1, 16)


def test_max_tokens(tok):
    prompt = chat(tok).prompts[0]
    assert chat(tok).params.max_new_tokens == CTX - len(prompt)      # unset: up to the context
    assert chat(tok, max_tokens=7, max_completion_tokens=5).params.max_new_tokens == 5
    with pytest.raises(OpenAIBadRequest, match="max_completion_tokens is too large"):
        chat(tok, max_tokens=CTX + 1)
    with pytest.raises(OpenAIBadRequest, match="exceeds the model's maximum context length"):
        chat(tok, max_tokens=CTX - 1)
    with pytest.raises(OpenAIBadRequest, match="max_tokens must be positive"):
        completion(tok, max_tokens=0)


def test_seeded_samples_differ_by_index(tok):
    job = chat(tok, n=3, seed=11)
    assert [job.sample_params(j).sampling_seed for j in range(3)] == [11, 12, 13]
    assert chat(tok, n=2).sample_params(1).sampling_seed is None


def test_a_final_assistant_message(tok):
    template = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    turn = [*USER, {"role": "assistant", "content": "The sum"}]
    cont = chat(tok, messages=turn, continue_final_message=True).prompts[0]
    assert tok.decode(cont) == template + "The sum"                  # continued, no new turn
    as_user = chat(tok, messages=turn).prompts[0]                    # else it becomes a user turn
    assert tok.decode(as_user) == tok.apply_chat_template(
        [*USER, {"role": "user", "content": "The sum"}], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 0.1}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"tool_choice": "required"}, "tool_choice"),
    ({"n": 0}, "n"), ({"stream": "yes"}, "stream"), ({"model": "base:adapter"}, "model"),
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"stream": True, "return_token_ids": True}, "return_token_ids"),
])
def test_refused_fields_are_named(tok, body, field):
    with pytest.raises(OpenAIBadRequest) as err:
        chat(tok, **body)
    assert err.value.param == field and field in str(err.value)


def test_ignored_and_neutral_fields_pass(tok):
    job = chat(tok, user="me", parallel_tool_calls=False, frequency_penalty=0.0, logit_bias={}, tools=[],
               response_format={"type": "text"}, tool_choice="none", no_such_field=[1])
    assert job.prompts and not job.stream
    assert completion(tok, best_of=1, suffix="!", echo=False, logprobs=0).logprobs is True
