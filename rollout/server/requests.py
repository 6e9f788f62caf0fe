"""Request bodies of the HTTP API, parsed and validated into engine requests.

Shapes follow SGLang 0.5.x (`GenerateReqInput` and the weight-update inputs of io_struct.py).
Anything malformed becomes `BadRequest` with a message naming the field, which the HTTP layer
turns into a 400; the server never sees a half-valid request.
"""
from __future__ import annotations

import json

from .engine import Request
from .sampling import BadRequest, parse_sampling_params

_MISSING = object()
# No tokenizer makes one token of more characters than this (long whitespace runs included):
# a text longer than context_len times it cannot fit and is refused without being tokenized.
MAX_CHARS_PER_TOKEN = 64

# GenerateReqInput fields accepted only at their neutral value (multimodal, sessions, ...);
# `lora_path` is taken off the body before (lora_routes.py `request_adapter`).
_NEUTRAL_GENERATE = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "lora_id": None, "session_params": None, "custom_logit_processor": None,
    "return_hidden_states": False, "modalities": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "bootstrap_pair_key": None, "data_parallel_rank": None, "background": False,
    "top_logprobs_num": 0, "token_ids_logprob": None, "return_entropy": False, "return_bytes": False,
    "stream": False,
}
_IGNORED_GENERATE = {"log_metrics", "conversation_id", "priority", "extra_key", "no_logs", "custom_labels",
                     "validation_time", "http_worker_ipc"}

# Sequences one request may ask for (prompts x n): SGLang sets no bound, and one /generate of
# n = 100,000 from a holder of the API key once queued 82,080 requests and stopped a run's
# generation for minutes (docs/generation.md: where the embedded server differs).
MAX_SEQUENCES = 1024


def is_json_media_type(content_type: str | None) -> bool:
    """FastAPI's rule for reading a body as JSON: `application/json` or `application/*+json`
    (parameters such as `; charset=utf-8` allowed, case-insensitive)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json(request, *, required: bool = True) -> dict:
    """The body as a JSON object ({} for an empty body when not `required`).

    A body is read only when its Content-Type says JSON, as SGLang 0.5.23's FastAPI routes read
    it (`fastapi/routing.py`: another type, such as curl `-d`'s form type, is kept as bytes and
    fails the request class's validation, a 400; with no Content-Type, FastAPI's default
    `strict_content_type=True` does the same). A client that works here then works on SGLang."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest(f"{request.path}: the request body must be a JSON object")
        return {}
    content_type = request.headers.get("Content-Type")
    if not is_json_media_type(content_type):
        raise BadRequest(f"{request.path}: a JSON body needs the header Content-Type: application/json, as "
                         f"SGLang requires (got {repr(content_type) if content_type else 'none'})")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"{request.path}: malformed JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: the request body must be a JSON object, got {type(body).__name__}")
    return body


def field(body: dict, key: str, kind, default=_MISSING, where: str = ""):
    """`body[key]` checked against `kind` (a type or tuple of types); bools are not ints."""
    if key not in body or body[key] is None:
        if default is _MISSING:
            raise BadRequest(f"{where}: missing required field {key!r}")
        return default
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"{where}.{key} must be {_names(kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, kinds):
        raise BadRequest(f"{where}.{key} must be {_names(kinds)}, got {type(value).__name__} {value!r:.60}")
    return value


def _names(kinds) -> str:
    return " or ".join({str: "a string", int: "an integer", float: "a number", bool: "true/false",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


def _per_item(value, n: int, key: str, check):
    """SGLang allows one value for the whole batch or a list with one per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"/generate.{key}: a list must have one entry per prompt ({n}), got {len(value)}")
        return [check(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return [check(value, key)] * n


def _token_list(ids, where: str, vocab: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"/generate.{where} must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"/generate.{where}: token ids must be integers, got {t!r:.40}")
        if not 0 <= t < vocab:
            raise BadRequest(f"/generate.{where}: token id {t} outside the vocabulary [0, {vocab})")
    return ids


def text_to_input_ids(body: dict, *, tokenizer, context_len: int) -> dict:
    """`body` with its `text` (a string or a list of them) tokenized into `input_ids` of the same
    shape; unchanged without text, or with both (parse_generate refuses that). The slow part of a
    request, so the HTTP layer runs it off the event loop; a text too long for the context is
    refused before it is tokenized."""
    text = body.get("text")
    if text is None or body.get("input_ids") is not None:
        return body
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("/generate.text must be a string or a non-empty list of strings")
    limit = context_len * MAX_CHARS_PER_TOKEN
    for i, t in enumerate(texts):
        if len(t) > limit:
            where = "/generate.text" if isinstance(text, str) else f"/generate.text[{i}]"
            raise BadRequest(f"{where}: {len(t):,} characters cannot fit the context of {context_len} tokens "
                             f"(at most {MAX_CHARS_PER_TOKEN} characters per token)")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    rest = {k: v for k, v in body.items() if k != "text"}
    return {**rest, "input_ids": ids[0] if isinstance(text, str) else ids}


def parse_generate(body: dict, *, tokenizer, vocab: int, context_len: int, on_done_factory
                   ) -> tuple[list[Request], bool]:
    """A `/generate` body -> engine requests, and whether the input was a single prompt."""
    for key, neutral in _NEUTRAL_GENERATE.items():
        if body.get(key) not in (None, neutral):
            raise BadRequest(f"/generate.{key}={body[key]!r:.60} is not supported by the embedded server")
    known = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
             "return_text_in_logprobs", "rid", "return_routed_experts", "routed_experts_start_len"
             } | set(_NEUTRAL_GENERATE) | _IGNORED_GENERATE
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"/generate: unknown field(s) {unknown}")
    body = text_to_input_ids(body, tokenizer=tokenizer, context_len=context_len)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("/generate: give exactly one of 'text' or 'input_ids'")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("/generate.input_ids must be a non-empty list of token ids (or of lists of them)")
    single = not isinstance(input_ids[0], list)
    prompts = ([_token_list(input_ids, "input_ids", vocab)] if single else
               [_token_list(p, f"input_ids[{i}]", vocab) for i, p in enumerate(input_ids)])
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != len(prompts):
            raise BadRequest(f"/generate.sampling_params: a list must have one entry per prompt "
                             f"({len(prompts)}), got {len(raw_params)}")
        params = [parse_sampling_params(p, f"/generate.sampling_params[{i}]") for i, p in enumerate(raw_params)]
    else:
        params = [parse_sampling_params(raw_params, "/generate.sampling_params")] * len(prompts)
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest("/generate.sampling_params: n must be the same for every prompt")
    if len(prompts) * n > MAX_SEQUENCES:   # before anything is made of it (a documented difference)
        raise BadRequest(f"/generate asks for {len(prompts)} prompt(s) x n={n} sequences; at most {MAX_SEQUENCES} "
                         f"per request")
    if n > 1:        # SGLang's parallel sampling: the prompt list repeated n times
        prompts, params, single = prompts * n, params * n, False
    count = len(prompts)

    def as_bool(v, k):
        if v is None:
            return False
        if not isinstance(v, bool):
            raise BadRequest(f"/generate.{k} must be true or false, got {v!r:.40}")
        return v

    def as_int(v, k):
        if v is None:
            return -1
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"/generate.{k} must be an integer, got {v!r:.40}")
        return v

    def as_rid(v, k):
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"/generate.{k} must be a string, got {v!r:.40}")
        return v

    logprob = _per_item(body.get("return_logprob"), count, "return_logprob", as_bool)
    start = _per_item(body.get("logprob_start_len"), count, "logprob_start_len", as_int)
    text_lp = as_bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    # One value for the whole batch (GenerateReqInput's `bool` / `int`, not per prompt).
    routed = as_bool(body.get("return_routed_experts"), "return_routed_experts")
    routed_start = body.get("routed_experts_start_len")
    routed_start = 0 if routed_start is None else as_int(routed_start, "routed_experts_start_len")
    rid = body.get("rid")
    if isinstance(rid, list):
        rids = _per_item(rid, count, "rid", as_rid)
    elif rid is not None:
        rid = as_rid(rid, "rid")
        rids = [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]
    else:
        rids = [None] * count
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if len(prompt) >= context_len:
            raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's context "
                             f"length ({context_len} tokens).")
        if "max_new_tokens" in _raw(raw_params, i) and len(prompt) + p.max_new_tokens > context_len:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                             f"{context_len} tokens. You requested a total of {len(prompt) + p.max_new_tokens} "
                             f"tokens: {len(prompt)} tokens from the input and {p.max_new_tokens} for the completion.")
        if routed and not 0 <= routed_start <= len(prompt):
            # SGLang's scheduler checks the same bounds (and aborts the request with these words).
            raise BadRequest(f"routed_experts_start_len={routed_start} is outside [0, {len(prompt)}] (the number "
                             f"of input tokens). Please use a non-negative routed_experts_start_len no higher "
                             f"than the input.")
        r = Request(prompt_ids=list(prompt), params=p, on_done=on_done_factory(i), return_logprob=logprob[i],
                    logprob_start_len=start[i], return_text_in_logprobs=text_lp,
                    return_routed_experts=routed, routed_experts_start_len=routed_start)
        if rids[i] is not None:
            r.rid = rids[i]
        reqs.append(r)
    return reqs, single


def _raw(raw_params, i: int) -> dict:
    if isinstance(raw_params, list):
        return raw_params[i % len(raw_params)] or {}
    return raw_params or {}
