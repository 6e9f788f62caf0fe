"""OpenAI-compatible requests, read as SGLang 0.5.23 reads them, into engine work (a `Job`).

Evaluation harnesses and agent frameworks speak the OpenAI API, and SGLang serves it next to its
native `/generate`; so the embedded server must accept the same requests and answer with the
same JSON, or a harness that works against a GPU server breaks on a CPU one. The contract is the
pinned wheel's `sglang/srt/entrypoints/openai/protocol.py` (`CompletionRequest`,
`ChatCompletionRequest`), `serving_completions.py` and `serving_chat.py` (how a request becomes
a prompt and sampling parameters). This module is only that mapping — no HTTP, no engine: a body
becomes a `Job` (token ids per prompt, sampling parameters, what the reply must carry);
`openai_shapes` writes the replies.

Fields follow the release's rules: a field the release's pydantic model does not have is dropped
(as pydantic does); a field the release reads but that means nothing here (routing hints,
`user`, `best_of`, ...) is accepted and ignored; a field the release honours and this server
cannot (penalties, grammars, LoRA, multimodal input, tools, top log-probs, `echo`) is accepted
only at its neutral value, else a 400 naming it — never a silently different answer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .requests import MAX_CHARS_PER_TOKEN, MAX_SEQUENCES
from .sampling import BadRequest, SamplingParams, parse_sampling_params

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEFAULT_MODEL_NAME = "default"          # protocol.py DEFAULT_MODEL_NAME, the `model` field's default
COMPLETION_MAX_TOKENS = 16              # CompletionRequest.max_tokens default

# Honoured by the release, accepted here only at these values (None always passes).
_NEUTRAL_COMMON = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "min_p": (0,), "min_tokens": (0,),
    "regex": (), "ebnf": (), "repetition_penalty": (1,), "stop_regex": ([],), "lora_path": (),
    "session_id": (), "session_params": (), "response_format": ({"type": "text"},), "custom_params": (),
    "custom_logit_processor": (), "watermark": (), "images_config": (), "mm_processor_kwargs": (),
    "return_hidden_states": (False,), "return_routed_experts": (False,), "return_cached_tokens_details": (False,),
    "return_spec_tokens_details": (False,),
}
NEUTRAL = {
    COMPLETIONS: {**_NEUTRAL_COMMON, "echo": (False,), "json_schema": ()},
    CHAT: {**_NEUTRAL_COMMON, "top_logprobs": (0,), "tools": ([],), "return_input_ids_in_sglext": (False,),
           "return_output_ids_in_sglext": (False,), "return_sampling_mask": (False,), "sampling_logprobs_mode": (),
           "return_flat_raw_output_top_logprobs": (False,), "max_dynamic_patch": (), "min_dynamic_patch": (),
           "use_audio_in_video": (False,), "video_config": ()},
}
# Read by the release but without effect on a single CPU server with no reasoning or tool parser.
_IGNORED_COMMON = {"user", "routed_experts_start_len", "data_parallel_rank", "routed_dp_rank",
                   "disagg_prefill_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room", "extra_key",
                   "cache_salt", "priority"}
IGNORED = {
    COMPLETIONS: _IGNORED_COMMON | {"best_of", "suffix", "custom_labels"},
    CHAT: _IGNORED_COMMON | {"parallel_tool_calls", "return_flat_raw_top_logprobs_b64", "thinking", "task",
                             "separate_reasoning", "stream_reasoning"},
}
# Read and honoured here. With NEUTRAL and IGNORED these are every field of the release's request
# models (the contract test checks it, so a field a new release adds cannot go unnoticed).
_HANDLED_COMMON = {"model", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "top_k",
                   "stop_token_ids", "no_stop_trim", "ignore_eos", "skip_special_tokens", "logprobs", "max_tokens",
                   "rid", "return_token_ids"}
HANDLED = {
    COMPLETIONS: _HANDLED_COMMON | {"prompt"},
    CHAT: _HANDLED_COMMON | {"messages", "max_completion_tokens", "continue_final_message", "chat_template_kwargs",
                             "reasoning_effort", "input_ids", "return_prompt_token_ids", "return_meta_info",
                             "tool_choice"},
}
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
MEDIA_PARTS = ("image_url", "input_image", "video_url", "audio_url", "input_audio")


class OpenAIBadRequest(BadRequest):
    """A 400 whose `param` names the request field at fault. `err_type` as the release types it:
    "Bad Request" for a body its pydantic model refuses, "BadRequestError" for the serving checks."""

    def __init__(self, message: str, param: str | None = None, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.param, self.err_type = param, err_type


@dataclass
class Job:
    """One OpenAI request, ready for the engine: prompts in order, `n` samples each."""
    route: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False          # completions: choice token ids; chat: prompt + response ids
    return_prompt_token_ids: bool = False   # chat only
    return_meta_info: bool = False          # chat only
    rid: str | list | None = None

    def sample_params(self, sample: int) -> SamplingParams:
        """Sample j of a prompt draws from seed + j: n samples of one seeded request must differ."""
        if self.params.sampling_seed is None:
            return self.params
        return dataclasses.replace(self.params, sampling_seed=self.params.sampling_seed + sample)


def _check_fields(body: dict, route: str) -> None:
    for key, neutral in NEUTRAL[route].items():
        value = body.get(key)
        if value is not None and not any(value == v for v in neutral):
            allowed = " or ".join(repr(v) for v in (None, *neutral))
            raise OpenAIBadRequest(f"{route}: `{key}`={value!r:.80} is not supported by the embedded server "
                                   f"(only {allowed})", key)


def _get(body: dict, key: str, kind, route: str, default=None):
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
                 dict: "an object"}
        raise OpenAIBadRequest(f"{route}: `{key}` must be {' or '.join(names[k] for k in kinds)}, "
                               f"got {value!r:.60}", key, "Bad Request")
    return value


def _sampling(body: dict, route: str, max_new_tokens: int, defaults: dict) -> SamplingParams:
    """The request's sampling fields in SGLang's `sampling_params` vocabulary, validated by the
    same parser as `/generate` (its messages name the key)."""
    seed = _get(body, "seed", int, route)
    raw = {"max_new_tokens": max_new_tokens, "sampling_seed": seed}
    for key in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "no_stop_trim"):
        value = body.get(key)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            raw[key] = value
    return parse_sampling_params(raw, route)


def _common(body: dict, route: str, served_name: str) -> dict:
    _check_fields(body, route)
    model = _get(body, "model", str, route, DEFAULT_MODEL_NAME)
    if ":" in model and model != served_name:     # serving_base._parse_model_parameter: a LoRA adapter
        raise OpenAIBadRequest(f"{route}: `model`={model!r:.80} names a LoRA adapter ('base:adapter'); the "
                               f"embedded server serves none", "model")
    n = _get(body, "n", int, route, 1)
    if n < 1:
        raise OpenAIBadRequest(f"{route}: `n` must be >= 1, got {n}", "n")
    if n > MAX_SEQUENCES:   # as /generate (requests.py)
        raise OpenAIBadRequest(f"{route}: `n` must be <= {MAX_SEQUENCES}, got {n}", "n")
    stream = _get(body, "stream", bool, route, False)
    options = _get(body, "stream_options", dict, route, {})
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str) and not (isinstance(rid, list) and all(isinstance(r, str)
                                                                                          for r in rid)):
        raise OpenAIBadRequest(f"{route}: `rid` must be a string or a list of strings", "rid")
    return {"model": model, "n": n, "stream": stream, "rid": rid,
            "include_usage": bool(_get(options, "include_usage", bool, f"{route}.stream_options", False)),
            "continuous_usage": bool(_get(options, "continuous_usage_stats", bool, f"{route}.stream_options",
                                          False))}


def _check_lengths(route: str, prompts: list[list[int]], max_new: int | None, context_len: int) -> None:
    """The tokenizer manager's checks (`_validate_one_request`): the same 400s as `/generate`."""
    for p in prompts:
        if len(p) >= context_len:
            raise OpenAIBadRequest(f"The input ({len(p)} tokens) is longer than the model's context length "
                                   f"({context_len} tokens).")
        if max_new is not None and len(p) + max_new > context_len:
            raise OpenAIBadRequest(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {len(p) + max_new} tokens: {len(p)} tokens from the input and "
                f"{max_new} for the completion.", "max_tokens")


def _ids(ids, where: str, vocab: int) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise OpenAIBadRequest(f"{where} must be a non-empty list of token ids", where.rsplit(".", 1)[-1])
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIBadRequest(f"{where}: token id {bad} outside the vocabulary [0, {vocab})")
    return ids


def _encode(tokenizer, text: str, context_len: int, **kw) -> list[int]:
    if len(text) > context_len * MAX_CHARS_PER_TOKEN:
        raise OpenAIBadRequest(f"{len(text):,} characters cannot fit the context of {context_len} tokens")
    return list(tokenizer.encode(text, **kw))


def parse_completion(body: dict, *, tokenizer, vocab: int, context_len: int, served_name: str) -> Job:
    """A `/v1/completions` body -> Job (tokenizes: run it off the event loop). A text prompt is
    encoded as the release's tokenizer manager encodes `text` (the tokenizer's defaults)."""
    route = COMPLETIONS
    common = _common(body, route, served_name)
    prompt = body.get("prompt")
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise OpenAIBadRequest("Prompt cannot be empty", "prompt")   # serving_completions._validate_request
    if isinstance(prompt, str):
        prompts = [_encode(tokenizer, prompt, context_len)]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompts = [_encode(tokenizer, p, context_len) for p in prompt]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [_ids(prompt, f"{route}.prompt", vocab)]
    elif isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):
        prompts = [_ids(p, f"{route}.prompt[{i}]", vocab) for i, p in enumerate(prompt)]
    else:
        raise OpenAIBadRequest(f"{route}: `prompt` must be a string, a list of strings, a list of token ids "
                               f"or a list of lists of token ids", "prompt")
    max_tokens = _get(body, "max_tokens", int, route, COMPLETION_MAX_TOKENS)
    if max_tokens <= 0:
        raise OpenAIBadRequest("max_tokens must be positive", "max_tokens")   # CompletionRequest validator
    logprobs = _get(body, "logprobs", int, route)
    if logprobs:
        raise OpenAIBadRequest(f"{route}: `logprobs`={logprobs} asks for top alternatives, which the embedded "
                               f"server does not compute; `logprobs: 0` gives the sampled tokens' log-probs",
                               "logprobs")
    _check_lengths(route, prompts, max_tokens, context_len)
    return Job(route=route, prompts=prompts, params=_sampling(body, route, max_tokens, {}),
               logprobs=logprobs is not None,
               return_token_ids=bool(_get(body, "return_token_ids", bool, route, False)), **common)


def _message(msg, i: int) -> dict:
    where = f"{CHAT}.messages[{i}]"
    if not isinstance(msg, dict):
        raise OpenAIBadRequest(f"{where} must be an object", "messages")
    role = msg.get("role")
    if not isinstance(role, str) or (role != "user" and role.lower() not in GENERIC_ROLES):
        allowed = ", ".join(repr(r) for r in ("user", *GENERIC_ROLES))
        raise OpenAIBadRequest(f"{where}.role must be one of {allowed}, got {role!r:.40}", "messages")
    role = "user" if role == "user" else role.lower()
    content = msg.get("content")
    if content is None and role == "user":
        raise OpenAIBadRequest(f"{where}: a user message needs `content`", "messages")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in MEDIA_PARTS:
                raise OpenAIBadRequest(f"{where}.content[{j}]: {kind} input is not supported for this model "
                                       f"(text only)", "messages")
            elif kind in ("thinking", "reasoning") and role != "assistant":
                raise OpenAIBadRequest(f"{where}.content[{j}]: thinking content parts are only valid in assistant "
                                       f"messages", "messages")
            elif kind not in ("thinking", "reasoning", "tool_reference"):
                raise OpenAIBadRequest(f"{where}.content[{j}] must be a content part with a known `type`",
                                       "messages")
        content = " ".join(texts)     # jinja_template_utils: the 'string' content format
    elif content is not None and not isinstance(content, str):
        raise OpenAIBadRequest(f"{where}.content must be a string or a list of content parts", "messages")
    out = {k: v for k, v in msg.items() if v is not None}
    out.update(role=role, content=content if content is not None else "")
    return out


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs, with `reasoning_effort` (and `reasoning.effort`) folded in as the
    release's `normalize_reasoning_inputs` does: `thinking` / `enable_thinking` for the templates
    that read them, `reasoning_effort` for those that read that."""
    kwargs = dict(_get(body, "chat_template_kwargs", dict, CHAT, {}))
    if "chat_template" in kwargs:
        raise OpenAIBadRequest("Request-supplied chat_template (`chat_template_kwargs.chat_template`) is not allowed "
                               "(SGLang's --trust-request-chat-template permits it; the embedded server has no such "
                               "option)", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    reasoning = body.get("reasoning")
    if effort is None and isinstance(reasoning, dict):
        effort = reasoning.get("effort", reasoning.get("reasoning_effort"))
    if effort is not None:
        if not (effort in EFFORTS or (isinstance(effort, (int, float)) and not isinstance(effort, bool)
                                      and math.isfinite(effort) and 0 <= effort <= 0.99)):
            raise OpenAIBadRequest(f"{CHAT}: `reasoning_effort` must be one of {list(EFFORTS)} or a number in "
                                   f"[0, 0.99], got {effort!r:.40}", "reasoning_effort")
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def chat_prompt(body: dict, tokenizer, context_len: int) -> list[int]:
    """The messages through the model's chat template (render, then encode without special
    tokens: the template writes them), as serving_chat `_apply_jinja_template` does. A final
    assistant message continues (`continue_final_message`) or becomes a user turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIBadRequest("Messages cannot be empty.", "messages")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    prefix = None
    if msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], str):
        if _get(body, "continue_final_message", bool, CHAT, False):
            prefix, msgs = msgs[-1]["content"], msgs[:-1]
        else:
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIBadRequest("the model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **_template_kwargs(body))
    except OpenAIBadRequest:
        raise
    except Exception as e:     # jinja's raise_exception, undefined variables: the client's error
        raise OpenAIBadRequest(f"the chat template failed on these messages: {e}", "messages") from None
    ids = _encode(tokenizer, text, context_len, add_special_tokens=False)
    if prefix:
        extra = _encode(tokenizer, prefix, context_len)
        ids += extra[1:] if extra and extra[0] == tokenizer.bos_token_id else extra
    return ids


def parse_chat(body: dict, *, tokenizer, vocab: int, context_len: int, served_name: str, defaults: dict) -> Job:
    """A `/v1/chat/completions` body -> Job (applies the chat template: run it off the event loop).
    `defaults`: the model's generation_config sampling values, used where the request has none
    (the release's `--sampling-defaults model`, its default)."""
    route = CHAT
    common = _common(body, route, served_name)
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise OpenAIBadRequest(f"{route}: `tool_choice`={tool_choice!r:.60} needs tools, which the embedded "
                               f"server does not parse", "tool_choice")
    logprobs = bool(_get(body, "logprobs", bool, route, False))
    max_new = _get(body, "max_completion_tokens", int, route) or _get(body, "max_tokens", int, route)
    if max_new is not None and max_new > context_len:
        raise OpenAIBadRequest(f"max_completion_tokens is too large: {max_new}.This model supports at most "
                               f"{context_len} completion tokens.", "max_completion_tokens")
    if max_new is not None and max_new < 0:
        raise OpenAIBadRequest(f"{route}: `max_completion_tokens` must be >= 0, got {max_new}",
                               "max_completion_tokens")
    flags = {k: bool(_get(body, k, bool, route, False)) for k in ("return_prompt_token_ids", "return_token_ids",
                                                                 "return_meta_info")}
    if common["stream"]:
        for k, v in flags.items():
            if v:
                raise OpenAIBadRequest(f"{k} is not supported with streaming. Please set stream=false when "
                                       f"using {k}=true.", k)
    if body.get("input_ids") is not None:      # pre-computed prompt: the template is bypassed
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise OpenAIBadRequest("Messages cannot be empty.", "messages")
        prompt = _ids(body["input_ids"], f"{route}.input_ids", vocab)
    else:
        prompt = chat_prompt(body, tokenizer, context_len)
    _check_lengths(route, [prompt], max_new, context_len)
    budget = max_new if max_new is not None else context_len - len(prompt)   # None: up to the context
    return Job(route=route, prompts=[prompt], params=_sampling(body, route, budget, defaults),
               logprobs=logprobs, **flags, **common)


