"""Tool-call parsing (`tandem.rollout.tool_calls`): each format's calls, the content around them,
malformed JSON, names not among the tools, and which format a chat template teaches.

The same semantics are held to SGLang 0.5.23's own detectors, case by case, in
tests/integration/contract/test_tool_call_contract.py; here each rule is stated on its own.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.rollout.tool_calls import FORMATS, ToolCall, detect_format, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ADD = '{"name": "add", "arguments": {"a": 3, "b": 5}}'
WEATHER = '{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
L_ADD = '{"name": "add", "parameters": {"a": 3, "b": 5}}'
L_WEATHER = '{"name": "get_weather", "parameters": {"city": "Tokyo"}}'


def parsed(text: str, fmt: str, tools=TOOLS):
    content, calls = parse_tool_calls(text, fmt, tools)
    for c in calls:
        assert isinstance(c, ToolCall) and isinstance(c.arguments, str)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


ADD_CALL, WEATHER_CALL = ("add", {"a": 3, "b": 5}), ("get_weather", {"city": "Tokyo"})


# ---- hermes -----------------------------------------------------------------------------------
def test_hermes_several_calls_and_the_text_before_them():
    text = f"<think>\nBoth.\n</think>\n\nLet me look.\n<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert parsed(text, "hermes") == ("<think>\nBoth.\n</think>\n\nLet me look.", [ADD_CALL, WEATHER_CALL])


def test_hermes_text_between_and_after_blocks_is_dropped_as_sglang_does():
    text = f"Sure. <tool_call>{ADD}</tool_call> and <tool_call>{WEATHER}</tool_call> done"
    assert parsed(text, "hermes") == ("Sure.", [ADD_CALL, WEATHER_CALL])


def test_hermes_without_a_block_leaves_the_text_untouched():
    assert parsed("  The answer is 8.\n", "hermes") == ("  The answer is 8.\n", [])


def test_hermes_one_malformed_block_makes_the_whole_text_content():
    text = f"x <tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n{{\"name\": \"add\", }}\n</tool_call>"
    assert parsed(text, "hermes") == (text, [])
    truncated = '<tool_call>\n{"name": "add", "arguments": {"a": 3'
    assert parsed(truncated, "hermes") == (truncated, [])
    assert parsed("<tool_call>42</tool_call>", "hermes") == ("<tool_call>42</tool_call>", [])


def test_hermes_an_unclosed_last_block_that_is_complete_json_is_a_call():
    assert parsed(f"<tool_call>\n{ADD}", "hermes") == ("", [ADD_CALL])


def test_hermes_a_list_in_one_block_is_several_calls():
    assert parsed(f"<tool_call>[{ADD}, {WEATHER}]</tool_call>", "hermes") == ("", [ADD_CALL, WEATHER_CALL])


def test_arguments_keys_and_values_as_sglang_reads_them():
    def one(obj: str):
        return parsed(f"<tool_call>{obj}</tool_call>", "hermes")[1]

    assert one('{"name": "add", "parameters": {"a": 1}}') == [("add", {"a": 1})]
    assert one('{"name": "add", "parameters": {}, "arguments": {"a": 1}}') == [("add", {"a": 1})]
    assert one('{"name": "add"}') == [("add", {})]
    assert one('{"name": "add", "arguments": "{\\"a\\": 1}"}') == [("add", '{"a": 1}')]   # a string stays one
    _, calls = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}'
                                '</tool_call>', "hermes", TOOLS)
    assert calls == [ToolCall("get_weather", '{"city": "Zürich 東京"}')]


# ---- names and tools --------------------------------------------------------------------------
def test_names_not_among_the_tools_are_dropped_with_their_text():
    text = f'Hi <tool_call>{{"name": "search", "arguments": {{}}}}</tool_call><tool_call>{WEATHER}</tool_call>'
    assert parsed(text, "hermes") == ("Hi", [WEATHER_CALL])
    assert parsed(f'[TOOL_CALLS] [{{"name": "search", "arguments": {{}}}}, {ADD}]', "mistral") == ("", [ADD_CALL])
    assert parsed('{"name": "search", "parameters": {}}', "llama3") == ("", [])


def test_tools_none_checks_no_name_and_an_empty_list_drops_every_call():
    text = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    assert parsed(text, "hermes", None) == ("", [("search", {"q": "x"})])
    assert parsed(text, "hermes", []) == ("", [])
    assert parsed('<tool_call>{"name": "", "arguments": {}}</tool_call>', "hermes", None) == ("", [])
    assert parsed('<tool_call>{"name": 7}</tool_call>', "hermes", None) == ("", [])
    bare = [{"name": "search"}]     # a bare function definition is read too
    assert parsed(text, "hermes", bare) == ("", [("search", {"q": "x"})])


def test_a_call_that_is_not_an_object_or_a_list_name_makes_the_whole_text_content():
    # SGLang's detectors raise there and its chat server answers the whole text, no calls
    for text, fmt in [("Hi [TOOL_CALLS] [1, 2]", "mistral"), (f"<|python_tag|>[{L_ADD}]", "llama3"),
                      ('<tool_call>{"name": ["add"]}</tool_call>', "hermes")]:
        assert parsed(text, fmt) == (text, [])


def test_json_nested_past_the_decoders_depth_is_content_not_an_exception():
    # a sampled text can be thousands of '[': json raises RecursionError, SGLang's server answers the text
    for text, fmt in [("<tool_call>" + "[" * 100_000, "hermes"), ("{" + '"a":[' * 100_000, "llama3"),
                      ("[TOOL_CALLS] [" + "[" * 100_000 + "]" * 100_001, "mistral")]:
        assert parsed(text, fmt) == (text, [])


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3, mistral"):
        parse_tool_calls("x", "qwen25")
    assert FORMATS == ("hermes", "llama3", "mistral")


def test_tool_call_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToolCall("add", "{}").name = "x"


# ---- llama3 -----------------------------------------------------------------------------------
def test_llama3_calls_after_the_python_tag_or_at_the_start():
    assert parsed(f"Let me check. <|python_tag|>{L_WEATHER}", "llama3") == ("Let me check. ", [WEATHER_CALL])
    assert parsed(L_ADD, "llama3") == ("", [ADD_CALL])
    assert parsed(f" {L_ADD}", "llama3") == (f" {L_ADD}", [])      # not at the very start: no call
    assert parsed("The sum is 8.", "llama3") == ("The sum is 8.", [])


def test_llama3_several_calls_separated_by_semicolons():
    assert parsed(f"{L_ADD};{L_WEATHER}", "llama3") == ("", [ADD_CALL, WEATHER_CALL])
    assert parsed(f"<|python_tag|>{L_ADD}; {L_WEATHER};", "llama3") == ("", [ADD_CALL, WEATHER_CALL])
    assert parsed(f"{L_ADD}\n{L_WEATHER}", "llama3") == ("", [ADD_CALL, WEATHER_CALL])


def test_llama3_text_after_the_calls_is_content_and_garbage_between_them_is_skipped():
    assert parsed(f"{L_ADD}; I will wait.", "llama3") == ("I will wait.", [ADD_CALL])
    assert parsed(f"{L_ADD}; oops {L_WEATHER}", "llama3") == ("", [ADD_CALL, WEATHER_CALL])
    assert parsed(f"{L_ADD}Done", "llama3") == ("Done", [ADD_CALL])    # SGLang: "one" (docstring)


def test_llama3_malformed_json_is_content_and_python_dicts_are_calls():
    assert parsed('<|python_tag|>{"name": "add", "parameters": {"a": 3,', "llama3") == \
        ('{"name": "add", "parameters": {"a": 3,', [])
    assert parsed("<|python_tag|>{'name': 'add', 'parameters': {'a': 3, 'b': 5}}", "llama3") == ("", [ADD_CALL])
    code = 'Searching.<|python_tag|>brave_search.call(query="x")'
    assert parsed(code, "llama3") == ('Searching.brave_search.call(query="x")', [])


# ---- mistral ----------------------------------------------------------------------------------
def test_mistral_json_array_with_text_around():
    assert parsed(f"Sure.  [TOOL_CALLS] [{ADD}, {WEATHER}]  Anything else?", "mistral") == \
        ("Sure. Anything else?", [ADD_CALL, WEATHER_CALL])
    assert parsed("Just text [with brackets].", "mistral") == ("Just text [with brackets].", [])


def test_mistral_brackets_inside_strings_do_not_end_the_array():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "a [b] \\"]\\" c"}}] end'
    assert parsed(text, "mistral") == ("end", [("get_weather", {"city": 'a [b] "]" c'})])


def test_mistral_malformed_or_unclosed_arrays_give_no_calls():
    assert parsed('Hm. [TOOL_CALLS] [{"name": "add", "arguments": {a: 3}}] tail', "mistral") == ("Hm. tail", [])
    assert parsed('Hm. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 3', "mistral") == ("Hm.", [])
    assert parsed(f"[TOOL_CALLS][{ADD}]", "mistral") == ("", [])      # no space: neither layout (as SGLang)


def test_mistral_compact_layout():
    assert parsed('[TOOL_CALLS]add[ARGS]{"a": 3, "b": 5}', "mistral") == ("", [ADD_CALL])
    assert parsed('[TOOL_CALLSadd[ARGS{"a": 3, "b": 5}', "mistral") == ("", [ADD_CALL])
    two = 'Ok [TOOL_CALLS]add[ARGS]{"a":3,"b":5}[TOOL_CALLS]get_weather[ARGS]{"city":"Tokyo"} then'
    assert parsed(two, "mistral") == ("Ok then", [ADD_CALL, WEATHER_CALL])
    assert parsed('Hi [TOOL_CALLS]search[ARGS]{"q": "x"} after', "mistral") == ("Hi", [])
    assert parsed('[TOOL_CALLS]add[ARGS]{"a": NaN}', "mistral") == ("", [])


def test_mistral_a_second_array_stays_content():
    text = f"[TOOL_CALLS] [{ADD}] \n [TOOL_CALLS] [{WEATHER}]"
    assert parsed(text, "mistral") == (f"[TOOL_CALLS] [{WEATHER}]", [ADD_CALL])


# ---- detect_format ----------------------------------------------------------------------------
QWEN25 = ("{%- if tools %}<tools>{{- tool | tojson }}</tools>\nFor each function call, return a json object with "
          "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
          "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>{%- endif %}")
QWEN3 = "{{- '<|im_start|>assistant\\n' }}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
HERMES2PRO = '<tool_call>\n{"arguments": <args-dict>, "name": <function-name>}\n</tool_call>'
QWEN3_CODER = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>"
GLM45 = "{{ '<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>"
MISTRAL = '{%- if message.tool_calls %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
MISTRAL_COMPACT = '{{- "[TOOL_CALLS]" + tool.function.name + "[ARGS]" + arguments }}'
LLAMA31 = ('{{- "<|python_tag|>" + tool_call.name + ".call(" }}'
           '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}')
LLAMA32 = ('{%- if message.role == "ipython" or message.role == "tool" %}'
           '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
           '{"name": function name, "parameters": dictionary of argument name and its value}')
LLAMA3_NO_TOOLS = "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}"
LLAMA4 = "{{- '<|header_start|>ipython<|header_end|>' }}{{- '<|python_start|>' }}"
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,fmt", [
    (QWEN25, "hermes"), (QWEN3, "hermes"), (HERMES2PRO, "hermes"), (QWEN3_CODER, None), (GLM45, None),
    (MISTRAL, "mistral"), (MISTRAL_COMPACT, "mistral"), (LLAMA31, "llama3"), (LLAMA32, "llama3"),
    (LLAMA3_NO_TOOLS, None), (LLAMA4, None), (CHATML, None), ("", None), (None, None),
], ids=["qwen25", "qwen3", "hermes2pro", "qwen3-coder", "glm45", "mistral", "mistral-compact", "llama31",
        "llama32", "llama3-no-tools", "llama4", "chatml", "empty", "none"])
def test_detect_format(template, fmt):
    assert detect_format(template) == fmt
