"""The pinned release's own tool-call detectors, run on texts (a subprocess of the contract tests,
like `sglang_oracle.py`, whose wheel import it reuses).

    python -m sglang_tool_call_oracle --wheel W.whl --deps DIR --request cases.json --answer out.json

Input: `{"cases": [{"parser": P, "text": T, "tools": [OpenAI tool, ...]}, ...],
"quotes": [{"file": F, "quote": Q}, ...]}`. For each case, the detector that
`FunctionCallParser.ToolCallParserEnum` registers under `--tool-call-parser P` (read from
`function_call_parser.py` with `ast`) runs `detect_and_parse(T, tools)` — the one-shot parse the
chat server uses for a non-streamed reply — and the answer is `{"normal_text", "calls": [{"name",
"parameters"}]}`, or `{"error": "Type: message"}` where the detector raises. For each quote, whether
the wheel's file F contains Q verbatim: the contract test's cases say which wheel text each comes
from, and this keeps that true.

Imports: the detectors are the real modules from the wheel (zipimport, as `sglang_oracle.py`
does: `sglang` is a bare package whose path is the wheel, the light dependencies come first on
the path). Unlike the other oracles, nothing here imports Triton or torch, so SGLang's platform
stubs (which import torch) are not installed and the oracle runs in a fresh interpreter in about
a second, where a fork of the test's torch-loaded interpreter costs more. Importing
`function_call_parser` itself would pull every detector and xgrammar, so only the detectors named
are imported. Two imports a light install lacks are stood in for: `sglang.utils` (as in
`sglang_openai_oracle.py`) and `partial_json_parser`, which the detectors use only when
streaming (`_partial_json_loads`); its stand-in raises if it is ever called, so a one-shot parse
that needed it would fail the test instead of answering wrongly.
"""
from __future__ import annotations

import ast
import enum
import importlib
import sys
import types
import zipfile

from sglang_openai_oracle import load_protocol
from sglang_oracle import oracle_parser, read_request, write_answer

PARSER_FILE = "sglang/srt/function_call/function_call_parser.py"


def import_from_wheel(wheel: str, deps: str) -> None:
    sys.path.insert(0, deps)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [f"{wheel}/sglang"]
    sys.modules["sglang"] = pkg


def stand_in_partial_json_parser() -> None:
    class MalformedJSON(ValueError):
        pass

    class Allow(enum.IntFlag):
        STR, NUM, ARR, OBJ, NULL, BOOL, NAN, INFINITY, _INFINITY = (1 << i for i in range(9))
        ALL = (1 << 9) - 1

    def streaming_only(*_a, **_k):
        raise AssertionError("partial_json_parser is a stand-in: only streaming parses use it")

    root, core = types.ModuleType("partial_json_parser"), types.ModuleType("partial_json_parser.core")
    exceptions = types.ModuleType("partial_json_parser.core.exceptions")
    options = types.ModuleType("partial_json_parser.core.options")
    root.loads = root.ensure_json = streaming_only
    exceptions.MalformedJSON, options.Allow = MalformedJSON, Allow
    root.core, core.exceptions, core.options = core, exceptions, options
    for m in (root, core, exceptions, options):
        sys.modules[m.__name__] = m


def registered_detectors(wheel: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    """--tool-call-parser name -> (module, class), from `ToolCallParserEnum` and the imports."""
    tree = ast.parse(wheel.read(PARSER_FILE).decode())
    imported = {a.asname or a.name: node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "ToolCallParserEnum" and isinstance(node.value, ast.Dict)):
            return {k.value: (imported[v.id], v.id) for k, v in zip(node.value.keys, node.value.values, strict=True)}
    raise AssertionError(f"{PARSER_FILE}: no ToolCallParserEnum dict")


def main() -> None:
    a = oracle_parser().parse_args()
    req = read_request(a)
    import_from_wheel(a.wheel, a.deps)
    stand_in_partial_json_parser()
    protocol, _ = load_protocol()
    wheel = zipfile.ZipFile(a.wheel)
    registry = registered_detectors(wheel)
    results = []
    for case in req.get("cases", []):
        module, cls = registry[case["parser"]]
        detector = getattr(importlib.import_module(module), cls)()   # fresh: detectors keep state
        tools = [protocol.Tool.model_validate(t) for t in case["tools"]]
        try:
            r = detector.detect_and_parse(case["text"], tools)
            results.append({"normal_text": r.normal_text,
                            "calls": [{"name": c.name, "parameters": c.parameters} for c in r.calls]})
        except Exception as e:
            results.append({"error": f"{type(e).__name__}: {e}"})
    quotes = [q["quote"] in wheel.read(q["file"]).decode() for q in req.get("quotes", [])]
    write_answer(a, {"results": results, "quotes": quotes,
                     "detectors": {p: f"{m}.{c}" for p, (m, c) in registry.items()}})


if __name__ == "__main__":
    main()
