"""Finding the final answer in a reasoning model's response (math box, code block).

Reasoning models think first (`<think> ... </think>`) and answer after; only the answer counts,
so a box or a program written while thinking never scores.
"""
from __future__ import annotations

import re

THINK_END = "</think>"
THINK_START = "<think>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
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
    """(position, content) of every complete `\\boxed{...}` / `\\fbox{...}`, in order."""
    found = []
    for cmd in _BOX_COMMANDS:
        start = text.find(cmd + "{")
        while start >= 0:
            content = _braced(text, start + len(cmd))
            if content is not None:
                found.append((start, content.strip()))
            start = text.find(cmd + "{", start + 1)
    return sorted(found)


def _braced(text: str, i: int) -> str | None:
    """The content of the brace group opening at text[i] == '{', or None if it never closes."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":  # \{ and \} are literal braces
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def extract_program(response: str) -> tuple[str | None, str]:
    """(program, how it was found) from a response; program None when there is none.

    Order: the last fenced block tagged python; else the last fenced block of any language;
    else, with no fence at all, the whole answer text (small models answer with bare code).
    """
    text = answer_text(response)
    if text is None:
        return None, "unterminated <think> block"
    blocks = _FENCE.findall(text)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    if python:
        return python[-1], "last ```python block"
    if blocks:
        return blocks[-1][1], "last fenced block (no python tag)"
    if "```" in text:  # an opened fence that never closed: take what follows it
        tail = text[text.rfind("```") + 3:]
        tail = tail.split("\n", 1)[1] if "\n" in tail else ""
        if tail.strip():
            return tail, "unclosed fence"
    if text.strip():
        return text, "whole answer (no fenced block)"
    return None, "empty answer"
