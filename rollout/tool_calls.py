"""Tool calls in a model's text, parsed on Tandem's side: Qwen/Hermes, Llama 3.x and Mistral.

Why here and not in the server: an agent's turns are rendered and parsed by Tandem itself, so
the same path serves SGLang and the embedded server and the trainer receives the tokens that
were sampled, not a re-serialisation of them. What a call *is* must still be what SGLang 0.5.23
says, so that an agent sees the same calls whichever way it is served: each format answers as
that release's detector does in one-shot parsing (`detect_and_parse`, what its chat server uses
for a non-streamed reply) — `hermes` as `HermesDetector`, `llama3` as `Llama32Detector`,
`mistral` as `MistralDetector`; tests/integration/contract/test_tool_call_contract.py runs them
from the wheel on the same cases.

What all three share (SGLang's `BaseFormatDetector.parse_base_json`):
- a call is a JSON object with a `name`; its arguments are `parameters`, or when that is missing
  or empty `arguments`, or `{}`; they are passed on as JSON text whatever JSON value they are;
- a call whose name is empty, or (when `tools` are given) not the name of one of them, is
  dropped, its text with it (SGLang's default, `SGLANG_FORWARD_UNKNOWN_TOOLS` unset);
- where a 0.5.23 detector raises (a call that is a JSON value but not an object, a name that is
  a list or an object, JSON nested too deep to decode), SGLang's chat server answers the whole text as content with no calls
  (`serving_chat._process_tool_calls`); so does this module, without the exception.

Where this module deliberately differs:
- `tools=None` means "no name check" (SGLang always has a list; its server does not parse at
  all without tools). `tools=[]` drops every call, as the detector does.
- `llama3`: between calls, whitespace and one `;` are stepped over and the next value is read
  after whitespace. SGLang steps over exactly one character, whatever it is, and reads the next
  value only right there (else through its Python-literal fallback or a search for the next
  `{"name":`): `{...}Done` leaves content `one` there; `{...}{...}` raises there (whole text as
  content) and gives two calls here; `{...}; 5` is content `5` there and a malformed call (whole
  text as content) here.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass

FORMATS = ("hermes", "llama3", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # the arguments as JSON text (of an object, when the model wrote one)


class _Malformed(Exception):
    """A call that SGLang's detector raises on: the whole text becomes content."""


def parse_tool_calls(text: str, fmt: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls): the model's text with the tool calls taken out, and the calls.

    `tools` are OpenAI tool definitions (`{"type": "function", "function": {"name": ...}}`; a bare
    `{"name": ...}` is read too); None skips the name check. Unknown `fmt` raises ValueError.
    """
    parse = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}.get(fmt)
    if parse is None:
        raise ValueError(f"unknown tool-call format {fmt!r}; known formats: {', '.join(FORMATS)}")
    names = None if tools is None else {n for t in tools if (n := (t.get("function") or t).get("name"))}
    try:
        return parse(text, names)
    except (_Malformed, RecursionError):    # RecursionError: JSON nested past the parser's depth
        return text, []


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches (`<tool_call>` -> hermes (Qwen2/2.5/3, Hermes);
    `[TOOL_CALLS]` -> mistral; Llama 3.x's `<|python_tag|>`/ipython JSON -> llama3), None when it
    teaches none.

    Templates that wrap other layouts in `<tool_call>` are not hermes: Qwen3-Coder's XML
    (`<function=...><parameter=...>`) and GLM-4.5's `<arg_key>` pairs; nor is Llama 4
    (`<|header_start|>`, no `<|start_header_id|>`). SGLang 0.5.23's own template detection
    (`parser/template_detection.py`) knows none of the three formats by their markers, so
    this is Tandem's rule.
    """
    t = chat_template or ""
    if "<tool_call>" in t:
        return None if ("<function=" in t or "<arg_key>" in t) else "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "ipython" in t):
        return "llama3"
    return None


def _calls(items: list, names: set[str] | None) -> list[ToolCall]:
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise _Malformed
        name = item.get("name")
        if isinstance(name, (list, dict)) and name:     # SGLang: `name in tool_indices` raises
            raise _Malformed
        if not name or not isinstance(name, str) or (names is not None and name not in names):
            continue
        args = item.get("parameters") or item.get("arguments", {})
        out.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return out


# ---- hermes: <tool_call>{...}</tool_call> blocks --------------------------------------------
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _hermes(text: str, names: set[str] | None) -> tuple[str, list[ToolCall]]:
    """Every block holds one call or a JSON list of calls; an unclosed last block runs to the end
    of the text. Content is the text before the first block, stripped: text between and after
    blocks is dropped (as SGLang does). One block that is not JSON makes the whole text content."""
    first = text.find(_OPEN)
    if first == -1:
        return text, []
    found, pos = [], first
    while (start := text.find(_OPEN, pos)) != -1:
        start += len(_OPEN)
        end = text.find(_CLOSE, start)
        body, pos = (text[start:], len(text)) if end == -1 else (text[start:end], end + len(_CLOSE))
        if not body:
            continue
        try:
            value = json.loads(body.strip())
        except json.JSONDecodeError:
            raise _Malformed from None
        found.extend(value if isinstance(value, list) else [value])
    return text[:first].strip(), _calls(found, names)


# ---- llama3: JSON objects, optionally after <|python_tag|>, separated by ';' -----------------
_TAG = "<|python_tag|>"
_NEXT_CALL = '{"name":'
_NOTHING = object()


def _llama3(text: str, names: set[str] | None) -> tuple[str, list[ToolCall]]:
    """Calls start at `<|python_tag|>` (content is the text before it, as is) or at the very
    start of the text when it opens with `{`. Objects follow one another, `;` between them; a
    Python dict literal (single quotes) counts as one. Where none parses, the parse jumps to the
    next `{"name":`; what follows the last call (stripped) is content after the text before it."""
    if _TAG in text:
        before, _, body = text.partition(_TAG)
    elif text.startswith("{"):
        before, body = "", text
    else:
        return text, []
    found, pos, kept = [], 0, 0
    while pos < len(body):
        value, end = _value_at(body, pos)
        if value is not _NOTHING:
            found.append(value)
            pos = kept = _skip_separator(body, end)
            continue
        pos = body.find(_NEXT_CALL, pos + 1)
        if pos == -1:
            break
    return before + body[kept:].strip(), _calls(found, names)


def _value_at(body: str, pos: int) -> tuple[object, int]:
    """A JSON value, or a Python dict literal, starting at `pos` (after whitespace); its end."""
    while pos < len(body) and body[pos].isspace():
        pos += 1
    try:
        return json.JSONDecoder().raw_decode(body, pos)
    except json.JSONDecodeError:
        pass
    if pos >= len(body) or body[pos] != "{":
        return _NOTHING, pos
    depth = 0
    for i in range(pos, len(body)):     # braces counted as SGLang counts them: strings not skipped
        depth += {"{": 1, "}": -1}.get(body[i], 0)
        if depth == 0:
            try:
                value = ast.literal_eval(body[pos:i + 1])
                return (json.loads(json.dumps(value)), i + 1) if isinstance(value, dict) else (_NOTHING, pos)
            except Exception:           # not a literal, or not JSON-able (a set, bytes, ...)
                return _NOTHING, pos
    return _NOTHING, pos


def _skip_separator(body: str, pos: int) -> int:
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos + 1 if body.startswith(";", pos) else pos


# ---- mistral: [TOOL_CALLS] [{...}, ...]  or  [TOOL_CALLS]name[ARGS]{...} ---------------------
_MARKER, _ARRAY, _ARGS = "[TOOL_CALLS", "[TOOL_CALLS] [", "[ARGS"


def _mistral(text: str, names: set[str] | None) -> tuple[str, list[ToolCall]]:
    """Content is the text before `[TOOL_CALLS`, stripped, then what follows the calls. The JSON
    array form is read once (a second `[TOOL_CALLS] [...]` stays content); an array that never
    closes leaves only the text before; one that is not JSON gives no calls. The compact form
    `[TOOL_CALLS]name[ARGS]{...}` (delimiters `]` optional) repeats; when it yields no call,
    everything from the marker on is dropped."""
    at = text.find(_MARKER)
    if at == -1:
        return text, []
    before, part = text[:at].strip(), text[at:]
    if (arr := part.find(_ARRAY)) != -1:
        start = arr + len(_ARRAY) - 1
        end = _balanced_end(part, start)
        if end is None:
            return before, []
        try:
            calls = _calls(json.loads(part[start:end]), names)
        except json.JSONDecodeError:
            calls = []
        return _join(before, part[end:].strip()), calls
    calls, rest = [], part
    while (compact := _compact_call(rest)) is not None:
        name, args, end = compact
        calls += _calls([{"name": name, "arguments": args}], names)
        rest = rest[end:].strip()
    return (_join(before, rest), calls) if calls else (before, [])


def _compact_call(text: str) -> tuple[str, object, int] | None:
    """(name, arguments, end) of the first `[TOOL_CALLS]name[ARGS]{...}` in `text`, or None."""
    at = text.find(_MARKER)
    if at == -1:
        return None
    i = _skip_ws(text, at + len(_MARKER) + text.startswith("]", at + len(_MARKER)))
    args_at = text.find(_ARGS, i)
    if args_at == -1 or not (name := text[i:args_at].strip()):
        return None
    j = _skip_ws(text, args_at + len(_ARGS) + text.startswith("]", args_at + len(_ARGS)))
    end = _balanced_end(text, j) if text[j:j + 1] in ("{", "[") else None
    if end is None:
        return None
    try:                                # strict JSON (SGLang checks with orjson: no NaN/Infinity)
        return name, json.loads(text[j:end], parse_constant=_reject), end
    except (json.JSONDecodeError, ValueError):
        return None


def _balanced_end(text: str, start: int) -> int | None:
    """End of the bracketed value opening at `start`, counting its bracket kind outside strings."""
    opening = text[start]
    closing = "]" if opening == "[" else "}"
    depth, in_string, escaped = 0, False, False
    for k in range(start, len(text)):
        ch = text[k]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
        elif not in_string and ch in (opening, closing):
            depth += 1 if ch == opening else -1
            if depth == 0:
                return k + 1
    return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _join(before: str, after: str) -> str:
    return f"{before} {after}".strip() if after else before


def _reject(constant: str):
    raise ValueError(f"{constant} is not JSON")
