"""Finding the final answer in a reasoning model's response (math box, code block).

Reasoning models think first (`<think> ... </think>`) and answer after; only the answer counts,
so a box or a program written while thinking never scores.
"""
from __future__ import annotations

import re

THINK_END = "</think>"
THINK_START = "<think>"
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\{")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)   # an escaped character, or a brace
_FENCE = "```"
_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_PYTHON_TAGS = {"python", "py", "python3", "python2"}


def answer_text(response: str) -> str | None:
    """The text after the last `</think>`; None when a `<think>` block never ends.

    An unterminated thinking block means the model ran out of tokens before answering: there is
    no answer, even if a box or a program appears inside the thoughts.
    """
    end = response.rfind(THINK_END)
    if end >= 0:
        return response[end + len(THINK_END):]
    if THINK_START in response:
        return None
    return response


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced.

    Only the last one counts: earlier boxes are intermediate results, and handing them all to
    the verifier would turn the answer into a set.
    """
    found = boxes(text)
    return found[-1][1] if found else None


def boxes(text: str) -> list[tuple[int, str]]:
    """(position, content) of every complete outermost `\\boxed{...}` / `\\fbox{...}`, in
    order; a box inside a box is part of its content (the answer contract reads it there)."""
    return [(start, content) for start, _, content in box_spans(text)]


def box_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every complete outermost box; `text[end]` is its closing brace.

    Linear in the text, whatever it holds: every brace is matched in one pass, so 12,000
    unclosed `\\boxed{` openings cost one scan, not one scan each (issue 32: 15 s before).
    """
    closing = _brace_pairs(text)
    found: list[tuple[int, int, str]] = []
    inside_until = -1
    for m in _BOX_OPENING.finditer(text):
        brace = m.end() - 1
        end = closing.get(brace)
        if end is None or m.start() < inside_until:   # never closes, or within the previous box
            continue
        found.append((m.start(), end, text[brace + 1:end].strip()))
        inside_until = end
    return found


def _brace_pairs(text: str) -> dict[int, int]:
    """Where each `{` of `text` closes (unclosed ones absent); `\\{` and `\\}` are literal
    braces. One pass with a stack: the pair of a brace depends only on what follows it, so this
    agrees with scanning forward from each opening."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN.finditer(text):
        c = m.group(0)
        if c == "{":
            stack.append(m.start())
        elif c == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def extract_program(response: str) -> tuple[str | None, str]:
    """(program, how it was found) from a response; program None when there is none.

    Order: the last fenced block tagged python; else the last fenced block of any language;
    else, with no fence at all, the whole answer text (small models answer with bare code).
    """
    text = answer_text(response)
    if text is None:
        return None, "unterminated <think> block"
    blocks, unclosed = fenced_blocks(text)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    if python:
        return python[-1], "last ```python block"
    if blocks:
        return blocks[-1][1], "last fenced block (no python tag)"
    if unclosed is not None and unclosed.strip():   # an opened fence that never closed
        return unclosed, "unclosed fence"
    if text.strip():
        return text, "whole answer (no fenced block)"
    return None, "empty answer"


def fenced_blocks(text: str) -> tuple[list[tuple[str, str]], str | None]:
    """((tag, body) of every closed fenced block, in order; the body after the last fence when
    that fence opens a block that never closes, else None).

    A fence opens at "```", its tag and info string run to the end of the line, its body to the
    next "```". Scanned with `str.find` from fence to fence, so the cost is linear in the text:
    a regex with the same meaning backtracks over a fence line with no newline (issue 32:
    "```" and 100 KB on one line took 7 s).
    """
    blocks: list[tuple[str, str]] = []
    at = text.find(_FENCE)
    while at >= 0:
        line_end = text.find("\n", at + 3)
        if line_end < 0:       # a fence with no body: nothing after it is a block
            return blocks, ""
        close = text.find(_FENCE, line_end + 1)
        if close < 0:
            return blocks, text[line_end + 1:]
        tag = _TAG.match(text, at + 3).group(1)
        blocks.append((tag, text[line_end + 1:close]))
        at = text.find(_FENCE, close + 3)
    return blocks, None
