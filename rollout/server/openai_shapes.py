"""OpenAI-compatible replies as SGLang 0.5.23 writes them: the JSON of every reply and chunk.

Why a module of its own: the reply JSON is the contract a client parses (`openai` raises on a
missing field, harnesses read `choices[i].text` or `message.content`, `usage`, `finish_reason`),
and it is checked field by field against the pinned wheel's pydantic models
(`tests/integration/contract/`). Sources in the wheel: `entrypoints/openai/protocol.py` (the
models and their serializers, which drop some `None` fields), `serving_completions.py` and
`serving_chat.py` (how engine replies fill them), `sse_utils.py` (the chat stream chunk, a
msgspec struct with its own omissions), `usage_processor.py` (`usage`) and
`utils/weight_versions.py` (`metadata`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .openai_requests import Job

CHAT = "/v1/chat/completions"


def error_response(message: str, code: int = 400, err_type: str = "BadRequestError", param: str | None = None
                   ) -> dict:
    """protocol.py `ErrorResponse`, the body of every OpenAI-route error (serving_base.py)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """protocol.py `UsageInfo` as `UsageProcessor.calculate_token_usage` fills it."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0,
            "completion_tokens_details": None}


def total_usage(results: list[dict], n: int) -> dict:
    """Prompt tokens once per prompt (results are prompt-major, n per prompt), completion tokens
    of every sample (`calculate_response_usage`)."""
    return usage(sum(results[i]["meta_info"]["prompt_tokens"] for i in range(0, len(results), n)),
                 sum(r["meta_info"]["completion_tokens"] for r in results))


def finish(meta: dict) -> tuple[str | None, int | str | None]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason["type"], reason.get("matched")


def completion_logprobs(triples: list) -> dict:
    """protocol.py `LogProbs` (`to_openai_style_logprobs`): no text offsets, no top alternatives."""
    return {"text_offset": [-1] * len(triples), "token_logprobs": [t[0] for t in triples],
            "tokens": [t[2] or "" for t in triples], "top_logprobs": []}


def chat_logprobs(triples: list) -> dict:
    """protocol.py `ChoiceLogprobs`: one `ChatCompletionTokenLogprob` per token."""
    return {"content": [{"token": t[2] or "", "bytes": list((t[2] or "").encode()), "logprob": t[0],
                         "top_logprobs": []} for t in triples]}


def completion_response(job: Job, results: list[dict], created: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish(r["meta_info"])
        choice = {"index": i, "text": r["text"],
                  "logprobs": completion_logprobs(r["meta_info"]["output_token_logprobs"]) if job.logprobs else None,
                  "finish_reason": reason, "matched_stop": matched}
        if job.return_token_ids:
            choice.update(token_ids=r["output_ids"], prompt_token_ids=job.prompts[i // job.n])
        choices.append(choice)
    return {"id": results[0]["meta_info"]["id"], "object": "text_completion", "created": created,
            "model": job.model, "choices": choices, "usage": total_usage(results, job.n),
            "metadata": weight_metadata(results[0]["meta_info"])}


def chat_response(job: Job, results: list[dict], created: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish(r["meta_info"])
        choice = {"index": i, "message": {"role": "assistant", "content": r["text"] or "", "reasoning_content": None},
                  "logprobs": chat_logprobs(r["meta_info"]["output_token_logprobs"]) if job.logprobs else None,
                  "finish_reason": reason, "matched_stop": matched}
        if job.return_prompt_token_ids or job.return_token_ids:
            choice["prompt_token_ids"] = job.prompts[0]
        if job.return_token_ids:
            choice["response_token_ids"] = r["output_ids"]
        if job.return_meta_info:
            choice["meta_info"] = r["meta_info"]
        choices.append(choice)
    return {"id": results[0]["meta_info"]["id"], "object": "chat.completion", "created": created,
            "model": job.model, "choices": choices, "usage": total_usage(results, job.n),
            "metadata": weight_metadata(results[0]["meta_info"])}


def weight_metadata(meta: dict) -> dict:
    """`build_endpoint_weight_version_metadata`: the policy version(s) that wrote the answer."""
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def chat_chunk(rid: str, created: int, model: str, index: int, *, role: str | None = None,
               content: str | None = None, finish_reason: str | None = None, matched_stop=None,
               logprobs: dict | None = None, usage: dict | None = None) -> dict:
    """sse_utils.py `StreamChunk` (msgspec, `omit_defaults`): `delta.reasoning_content` always
    present, `delta.role` / `delta.content` and `usage` only when set."""
    delta: dict = {"reasoning_content": None}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                        "matched_stop": matched_stop}]}
    if usage is not None:
        out["usage"] = usage
    return out


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, *, finish_reason=None,
                     matched_stop=None, logprobs: dict | None = None, usage: dict | None = None,
                     token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """protocol.py `CompletionStreamResponse` as `model_dump_json()` writes it (usage null unless set)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
              "matched_stop": matched_stop}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage}


def usage_chunk(job: Job, rid: str, created: int, totals: dict) -> dict:
    """The last chunk with `stream_options.include_usage`: no choices, the whole usage. The
    completions route dumps it with `exclude_none` (no null details), the chat route in full."""
    out = {"id": rid, "object": "chat.completion.chunk" if job.route == CHAT else "text_completion",
           "created": created, "model": job.model, "choices": [], "usage": totals}
    if job.route != CHAT:
        out["usage"] = {k: v for k, v in totals.items() if v is not None}
    return out


def model_list(name: str, context_len: int, created: int) -> dict:
    """`GET /v1/models` (http_server.py `available_models`): protocol.py `ModelList` of one `ModelCard`."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "sglang",
                                        "root": name, "parent": None, "max_model_len": context_len}]}
