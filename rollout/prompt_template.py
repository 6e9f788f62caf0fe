"""How a data set's problem is asked: `rollout.system_prompt` and `rollout.prompt_template`.

A model is trained and evaluated on the same words around its problems ("Think step by step and
put the final answer in \\boxed{}"), so the wording belongs in the experiment file, not in the
data. The template is a Python format string with one field, `{prompt}` (the problem text); the
result is the user message, a non-empty system prompt goes before it as a system message, and
the tokenizer's chat template turns the messages into token ids (rollout/workflow.py) — for
training and for every evaluation alike. Literal braces, as in `\\boxed{{}}`, are doubled.

The template is checked before a launch (`tandem config check`): one without `{prompt}` would
ask every problem the same question, and a field other than `{prompt}` (often a LaTeX brace
left single) would fail in a rollout worker after the run started.
"""
from __future__ import annotations

import string

FIELDS = ("prompt",)


def template_problem(template: str) -> str | None:
    """Why `template` cannot be used, or None ("" is no template: the problem as it is)."""
    if not template:
        return None
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return f"not a format string ({e}); write a literal brace as {{{{ or }}}}"
    if "prompt" not in names:
        return "must contain {prompt}, where the problem text goes"
    unknown = [n for n in dict.fromkeys(names) if n not in FIELDS]
    if unknown:
        return (f"unknown field {{{unknown[0]}}}: only {{prompt}} is filled in; write a literal brace "
                f"as {{{{ or }}}} (e.g. \\boxed{{{{}}}})")
    return None


def render(text: str, template: str = "") -> str:
    """The user message: the problem inside the template (the problem itself without one)."""
    return template.format(prompt=text) if template else text


def messages(text: str, system: str = "", template: str = "") -> list[dict]:
    """The chat messages that ask `text`: the system prompt (if any), then the user message."""
    user = {"role": "user", "content": render(text, template)}
    return [{"role": "system", "content": system}, user] if system else [user]
