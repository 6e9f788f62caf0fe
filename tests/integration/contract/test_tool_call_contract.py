"""Tandem's tool-call parsing (`tandem.rollout.tool_calls`) against SGLang 0.5.23's own detectors.

Every case runs through the detector the pinned release registers for the format
(`--tool-call-parser hermes / llama3 / mistral`: HermesDetector, Llama32Detector,
MistralDetector), from the wheel, in one oracle process (`sglang_tool_call_oracle.py`), and
through `parse_tool_calls`: content and calls (name, arguments as parsed JSON) must be equal.
Where the detector raises, the release's chat server answers the whole text as content with no
calls (`serving_chat._process_tool_calls`), and that is what Tandem must answer. Cases marked
`differs` are the deliberate differences the module's docstring lists: there Tandem's answer is
given, and SGLang's must still be another (so the list stays true when the release changes).

Cases taken from the wheel name the file and quote the text they come from (`src`, `quote`);
the oracle checks that the quote is in that file. The tools are the release's own test tools
(`ADD_TOOL`, `WEATHER_TOOL` of sglang/test/tool_call_test_runner.py). Qwen's own parser
(`qwen25`) is run on the hermes cases too: on well-formed blocks it must agree with `hermes`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.rollout.tool_calls import FORMATS, parse_tool_calls

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
FC = "sglang/srt/function_call/"
RUNNER = "sglang/test/tool_call_test_runner.py"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Compute the sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "First integer"},
                                                    "b": {"type": "integer", "description": "Second integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
TOOLS = [ADD, WEATHER]
A = '{"name": "add", "arguments": {"a": 3, "b": 5}}'
W = '{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
LA = '{"name": "add", "parameters": {"a": 3, "b": 5}}'
LW = '{"name": "get_weather", "parameters": {"city": "Tokyo"}}'


@dataclass(frozen=True)
class Case:
    id: str
    fmt: str
    text: str
    src: str | None = None          # the wheel file the case comes from
    quote: str | None = None        # the text of that file it is built on
    differs: tuple | None = None    # Tandem's (content, [(name, args)]) where it deliberately differs
    malformed: bool = False         # a hermes block that is not a well-formed call (qwen25 may differ)


CASES = [
    # ---- hermes ------------------------------------------------------------------------------
    Case("hermes-docstring-literal", "hermes", '<tool_call>{"name": "...", "arguments": {...}}</tool_call>',
         FC + "hermes_detector.py", '<tool_call>{"name": "...", "arguments": {...}}</tool_call>', malformed=True),
    Case("hermes-docstring-filled", "hermes", f"<tool_call>{A}</tool_call>",
         FC + "hermes_detector.py", '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'),
    Case("hermes-structure-info", "hermes", '<tool_call>{"name":"add", "arguments":{"a": 1, "b": 2}}</tool_call>',
         FC + "hermes_detector.py", """begin='<tool_call>{"name":"' + name + '", "arguments":',"""),
    Case("qwen25-docstring-two-calls", "hermes", f"<tool_call>\n{A}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>",
         FC + "qwen25_detector.py",
         '<tool_call>\\n{"name":"func1", "arguments":{...}}\\n</tool_call>\\n<tool_call>\\n{"name":"func2"'),
    Case("hermes-runner-parallel", "hermes", f"I'll call both.\n<tool_call>\n{A}\n</tool_call>\n"
         f"<tool_call>\n{W}\n</tool_call>", RUNNER, "use add to compute 3+5, and use get_weather"),
    Case("hermes-think-before", "hermes", f"<think>\nAdd them.\n</think>\n\nLet me compute.\n<tool_call>\n{A}\n</tool_call>"),
    Case("hermes-text-after-dropped", "hermes", f"Sure.\n<tool_call>\n{A}\n</tool_call>\nDone, waiting."),
    Case("hermes-text-between-dropped", "hermes", f"<tool_call>\n{A}\n</tool_call>\nand\n<tool_call>\n{W}\n</tool_call>"),
    Case("hermes-no-call", "hermes", "  The answer is 8.\n"),
    Case("hermes-unknown-name", "hermes", 'Hi <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'),
    Case("hermes-known-and-unknown", "hermes",
         f'<tool_call>\n{{"name": "search", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>'),
    Case("hermes-malformed-second", "hermes", f"x <tool_call>\n{A}\n</tool_call>\n<tool_call>\n{{\"name\": \"add\", }}\n"
         "</tool_call>", malformed=True),
    Case("hermes-unclosed-complete", "hermes", f"<tool_call>\n{A}", malformed=True),
    Case("hermes-unclosed-truncated", "hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 3', malformed=True),
    Case("hermes-list-in-block", "hermes", f"<tool_call>[{A}, {W}]</tool_call>"),
    Case("hermes-unicode", "hermes",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧", "n": "\\u00e9"}}\n</tool_call>'),
    Case("hermes-parameters-key", "hermes", f"<tool_call>\n{LA}\n</tool_call>"),
    Case("hermes-empty-parameters-falls-back", "hermes",
         '<tool_call>\n{"name": "add", "parameters": {}, "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    Case("hermes-string-arguments", "hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    Case("hermes-no-arguments", "hermes", '<tool_call>\n{"name": "add"}\n</tool_call>'),
    Case("hermes-not-an-object", "hermes", "<tool_call>\n42\n</tool_call>", malformed=True),
    Case("hermes-name-is-a-list", "hermes", '<tool_call>\n{"name": ["add"], "arguments": {}}\n</tool_call>',
         malformed=True),
    Case("hermes-nested-too-deep", "hermes", "<tool_call>" + "[" * 100_000, malformed=True),
    Case("hermes-empty-block", "hermes", f"<tool_call></tool_call><tool_call>{A}</tool_call>"),
    # ---- llama3 ------------------------------------------------------------------------------
    Case("llama32-docstring-literal", "llama3", '<python_tag>{"name":"xxx", "arguments":{...}}',
         FC + "llama32_detector.py", '<python_tag>{"name":"xxx", "arguments":{...}}'),
    Case("llama32-docstring-filled", "llama3", '<|python_tag|>{"name":"add", "arguments":{"a": 3, "b": 5}}',
         FC + "llama32_detector.py", """begin='<|python_tag|>{"name":"' + name + '", "arguments":',"""),
    Case("llama32-without-tag", "llama3", LA, FC + "llama32_detector.py",
         "may or may not\n        # prefix the output with the <|python_tag|> token"),
    Case("llama32-semicolon", "llama3", f"{LA};{LW}", FC + "llama32_detector.py", 'self.tool_call_separator = ";"'),
    Case("llama3-semicolon-space", "llama3", f"<|python_tag|>{LA}; {LW}"),
    Case("llama3-semicolon-space-json-true", "llama3",
         f'<|python_tag|>{LA}; {{"name": "get_weather", "parameters": {{"city": "Oslo", "metric": true}}}}'),
    Case("llama3-newline-and-final-semicolon", "llama3", f"<|python_tag|>{LA}\n{LW};"),
    Case("llama3-text-before-kept-as-is", "llama3", f"Let me check. <|python_tag|>{LW}"),
    Case("llama3-leading-space-no-tag", "llama3", f" {LA}"),
    Case("llama3-no-call", "llama3", "The sum is 8."),
    Case("llama3-trailing-text", "llama3", f"{LA}; I will wait for the result."),
    Case("llama3-malformed", "llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 3,'),
    Case("llama3-garbage-between", "llama3", f"{LA}; oops {LW}"),
    Case("llama3-python-dict", "llama3", "<|python_tag|>{'name': 'add', 'parameters': {'a': 3, 'b': 5}}",
         FC + "llama32_detector.py", "# Try Python dict conversion as fallback"),
    Case("llama3-unknown-name", "llama3", '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'),
    Case("llama3-unicode", "llama3", '{"name": "get_weather", "parameters": {"city": "Zürich 東京 🌧"}}'),
    Case("llama3-list-not-object", "llama3", f"<|python_tag|>[{LA}]"),
    Case("llama3-builtin-python", "llama3", 'Searching.<|python_tag|>brave_search.call(query="weather Tokyo")'),
    Case("llama3-no-separator-text", "llama3", f"{LA}Done",
         differs=("Done", [("add", {"a": 3, "b": 5})])),
    Case("llama3-back-to-back", "llama3", f"{LA}{LW}",
         differs=("", [("add", {"a": 3, "b": 5}), ("get_weather", {"city": "Tokyo"})])),
    Case("llama3-number-after-separator", "llama3", f"{LA}; 5", differs=(f"{LA}; 5", [])),
    # ---- mistral -----------------------------------------------------------------------------
    Case("mistral-docstring-literal", "mistral", '[TOOL_CALLS] [{"name": "...", "arguments": {...}}, ...]',
         FC + "mistral_detector.py", '`[TOOL_CALLS] [{"name": "...", "arguments": {...}}, ...]`'),
    Case("mistral-docstring-filled", "mistral", f"[TOOL_CALLS] [{A}, {W}]",
         FC + "mistral_detector.py", '`[TOOL_CALLS] [{"name": "...", "arguments": {...}}, ...]`'),
    Case("mistral-structure-info", "mistral", '[TOOL_CALLS] [{"name":"add", "arguments":{"a": 1, "b": 2}}]',
         FC + "mistral_detector.py", """begin='[TOOL_CALLS] [{"name":"' + name + '", "arguments":',"""),
    Case("mistral-compact-literal", "mistral", "[TOOL_CALLS]tool_name[ARGS]{...}",
         FC + "mistral_detector.py", "`[TOOL_CALLS]tool_name[ARGS]{...}`"),
    Case("mistral-compact-filled", "mistral", '[TOOL_CALLS]add[ARGS]{"a": 3, "b": 5}',
         FC + "mistral_detector.py", "`[TOOL_CALLS]tool_name[ARGS]{...}`"),
    Case("mistral-compact-missing-delimiters", "mistral", '[TOOL_CALLSadd[ARGS{"a": 1, "b": 2}',
         FC + "mistral_detector.py", "`[TOOL_CALLStool_name[ARGS{...}`"),
    Case("mistral-compact-two", "mistral", 'Ok [TOOL_CALLS]add[ARGS]{"a":1,"b":2}[TOOL_CALLS]get_weather[ARGS]'
         '{"city":"Paris"} then more'),
    Case("mistral-compact-nan", "mistral", '[TOOL_CALLS]add[ARGS]{"a": NaN}'),
    Case("mistral-two-blocks", "mistral", f"[TOOL_CALLS] [{A}] \n [TOOL_CALLS] [{W}]",
         FC + "base_format_detector.py", "Multiple separate blocks: [TOOL_CALLS] [...] \\n [TOOL_CALLS] [...]"),
    Case("mistral-text-around", "mistral", f"Sure.  [TOOL_CALLS] [{A}]  Anything else?"),
    Case("mistral-unclosed", "mistral", 'Hm. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 3'),
    Case("mistral-malformed-closed", "mistral", 'Hm. [TOOL_CALLS] [{"name": "add", "arguments": {a: 3}}] tail'),
    Case("mistral-unknown-and-known", "mistral", f'[TOOL_CALLS] [{{"name": "search", "arguments": {{}}}}, {W}]'),
    Case("mistral-compact-unknown", "mistral", 'Hi [TOOL_CALLS]search[ARGS]{"q": "x"} after'),
    Case("mistral-brackets-in-strings", "mistral",
         '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "a [b] \\"]\\" c"}}] end'),
    Case("mistral-unicode", "mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧"}}]'),
    Case("mistral-not-an-object", "mistral", "Hi [TOOL_CALLS] [1, 2]"),
    Case("mistral-no-space", "mistral", f"[TOOL_CALLS][{A}]"),
    Case("mistral-nested-too-deep", "mistral", "[TOOL_CALLS] [" + "[" * 100_000 + "]" * 100_001),
    Case("mistral-no-call", "mistral", "Just text [with brackets]."),
]


def ours(case: Case):
    content, calls = parse_tool_calls(case.text, case.fmt, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def theirs(case: Case, answer: dict):
    """SGLang's answer in the same shape; a detector that raised: the chat server's whole text."""
    if "error" in answer:
        return case.text, []
    return answer["normal_text"], [(c["name"], json.loads(c["parameters"])) for c in answer["calls"]]


def run_oracle(wheel, payload: dict) -> dict:
    """`sglang_tool_call_oracle.py` on the wheel, in a fresh interpreter (it imports no torch, so
    this is cheaper than `Wheel.run`'s fork of a torch-loaded one); its JSON answer."""
    with tempfile.TemporaryDirectory(prefix="sglang-tool-calls-") as tmp:
        request, answer = Path(tmp, "request.json"), Path(tmp, "answer.json")
        request.write_text(json.dumps(payload))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-m", "sglang_tool_call_oracle", "--wheel", str(wheel.path),
                               "--deps", str(wheel.deps), "--request", str(request), "--answer", str(answer)],
                              env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and answer.exists(), \
            f"the tool-call oracle exited {proc.returncode} on {wheel.name}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        return json.loads(answer.read_text())


@pytest.fixture(scope="module")
def oracle(sglang_wheel):
    hermes = [c for c in CASES if c.fmt == "hermes"]
    runs = [(c.fmt, c) for c in CASES] + [("qwen25", c) for c in hermes]
    quoted = [c for c in CASES if c.src]
    answer = run_oracle(sglang_wheel, {
        "cases": [{"parser": p, "text": c.text, "tools": TOOLS} for p, c in runs],
        "quotes": [{"file": c.src, "quote": c.quote} for c in quoted]})
    by_parser = {}
    for (p, c), r in zip(runs, answer["results"], strict=True):
        by_parser.setdefault(p, {})[c.id] = r
    return {"results": by_parser, "quoted": dict(zip([c.id for c in quoted], answer["quotes"], strict=True)),
            "detectors": answer["detectors"]}


def test_cases_cover_every_format_and_quote_the_wheel(oracle):
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.fmt for c in CASES} == set(FORMATS)
    assert oracle["detectors"]["hermes"].endswith("hermes_detector.HermesDetector")
    assert oracle["detectors"]["llama3"].endswith("llama32_detector.Llama32Detector")
    assert oracle["detectors"]["mistral"].endswith("mistral_detector.MistralDetector")
    missing = [cid for cid, found in oracle["quoted"].items() if not found]
    assert not missing, f"these cases quote text their wheel file does not hold: {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parse_agrees_with_the_release(case, oracle):
    answer = oracle["results"][case.fmt][case.id]
    if case.differs is None:
        assert ours(case) == theirs(case, answer), f"SGLang answered {answer}"
    else:
        content, calls = case.differs
        assert ours(case) == (content, [tuple(c) for c in calls])
        assert theirs(case, answer) != ours(case), f"no longer a difference: SGLang answered {answer}"


def test_hermes_agrees_with_qwen25_on_well_formed_blocks(oracle):
    """Qwen models are often served with `--tool-call-parser qwen25`: on well-formed calls (the
    blocks on lines of their own, as Qwen's template writes them) it answers as `hermes` does."""
    for case in (c for c in CASES if c.fmt == "hermes" and not c.malformed and "<tool_call>\n" in c.text):
        assert theirs(case, oracle["results"]["qwen25"][case.id]) == ours(case), case.id
