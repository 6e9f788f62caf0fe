"""The pinned release's OpenAI reply models, judging replies of the embedded server (a subprocess
of the contract tests, like `sglang_oracle.py`, whose wheel import it reuses).

    python sglang_openai_oracle.py --wheel W.whl --deps DIR  < replies.json  > verdicts.json

Input: `{"replies": [{"kind": K, "reply": JSON}, ...], "request_fields": [CLASS, ...]}`; the answer
has a verdict per reply and the field names of each request class named. Each reply is decoded with the class the
release builds that reply from and encoded again the way the release writes it; the result must
be the reply itself. A key the release never writes, a key it always writes but the reply lacks,
a value of the wrong type or outside a `Literal`, or a `None` field the release's serializer
drops (or keeps) all make the two differ. The kinds, with the release's class and encoder:

  models                  `ModelList`, FastAPI's JSON encoding (`GET /v1/models`, http_server.py)
  completion, chat        `CompletionResponse` / `ChatCompletionResponse`,
                          `model_dump_json(by_alias=True)` (utils/json_response.py)
  completion_chunk        `CompletionStreamResponse.model_dump_json()` (serving_completions.py)
  completion_usage_chunk  the same with `exclude_none=True` (its final usage chunk)
  chat_chunk              sse_utils.py `StreamChunk`, msgspec (role, content and finish chunks)
  chat_usage_chunk        `ChatCompletionStreamResponse.model_dump_json()` (serving_chat.py)
  error                   `ErrorResponse.model_dump()` (serving_base.py `create_error_response`)

`protocol.py` is the real module from the wheel. Its one import that a light install cannot
satisfy, `sglang.utils` (IPython, requests at import time), provides only
`convert_json_schema_to_str`, which request classes call when building sampling parameters —
never while a reply is decoded or encoded — so a stand-in module with that name is registered.
"""
from __future__ import annotations

import json
import sys
import types

from sglang_oracle import install_wheel, oracle_parser, read_request, write_answer


def load_protocol():
    utils = types.ModuleType("sglang.utils")
    utils.convert_json_schema_to_str = json.dumps
    sys.modules["sglang.utils"] = utils
    from sglang.srt.entrypoints.openai import protocol, sse_utils
    return protocol, sse_utils


def reencode(kind: str, reply, protocol, sse_utils):
    import msgspec

    if kind == "chat_chunk":
        chunk = msgspec.json.decode(json.dumps(reply).encode(), type=sse_utils.StreamChunk, strict=True)
        return json.loads(msgspec.json.encode(chunk))
    cls, dump = {
        "models": (protocol.ModelList, lambda m: m.model_dump(mode="json", by_alias=True)),
        "completion": (protocol.CompletionResponse, lambda m: json.loads(m.model_dump_json(by_alias=True))),
        "chat": (protocol.ChatCompletionResponse, lambda m: json.loads(m.model_dump_json(by_alias=True))),
        "completion_chunk": (protocol.CompletionStreamResponse, lambda m: json.loads(m.model_dump_json())),
        "completion_usage_chunk": (protocol.CompletionStreamResponse,
                                   lambda m: json.loads(m.model_dump_json(exclude_none=True))),
        "chat_usage_chunk": (protocol.ChatCompletionStreamResponse, lambda m: json.loads(m.model_dump_json())),
        "error": (protocol.ErrorResponse, lambda m: m.model_dump(mode="json")),
    }[kind]
    return dump(cls.model_validate_json(json.dumps(reply), strict=True))


def diff(want, got, path: str = "") -> list[str]:
    """Where `got` (the release's encoding) differs from `want` (the reply): key by key."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: the release never writes it" for k in sorted(set(want) - set(got))]
        out += [f"{path}.{k}: missing (the release writes {got[k]!r:.80})" for k in sorted(set(got) - set(want))]
        for k in sorted(set(want) & set(got)):
            out += diff(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [p for i, (w, g) in enumerate(zip(want, got, strict=True)) for p in diff(w, g, f"{path}[{i}]")]
    if want != got or type(want) is not type(got):
        return [f"{path or 'reply'}: {want!r:.80} is written back as {got!r:.80}"]
    return []


def main() -> None:
    a = oracle_parser().parse_args()
    install_wheel(a.wheel, a.deps)
    protocol, sse_utils = load_protocol()
    req = read_request(a)
    verdicts = []
    for item in req.get("replies", []):
        try:
            problems = diff(item["reply"], reencode(item["kind"], item["reply"], protocol, sse_utils))
        except Exception as e:     # pydantic / msgspec refusing the reply
            problems = [f"does not decode: {type(e).__name__}: {e}"]
        verdicts.append(problems)
    fields = {name: sorted(getattr(protocol, name).model_fields) for name in req.get("request_fields", [])}
    write_answer(a, {"verdicts": verdicts, "request_fields": fields})


if __name__ == "__main__":
    main()
