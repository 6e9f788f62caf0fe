"""A math agent with a calculator: `rollout.agent: tandem.rollout.agents.calculator:solve`.

The model may answer at once (`\\boxed{...}`) or call `calc` with an arithmetic expression,
read the result and then answer; the run's math grader scores the last reply. On the embedded
default (`make train-agent`) the warm-up teaches both, and RL learns when the tool pays.

The calculator is the model's to call, so it is written for an adversary: arithmetic only
(numbers, + - * /, parentheses, read with `ast`, never evaluated as Python), a bounded
expression length and bounded intermediate values, so no call can run long or grow large.
"""
from __future__ import annotations

import ast
import operator

from tandem.rollout.agent import AgentResult
from tandem.rollout.agent_tools import Toolbox

MAX_CHARS = 200
MAX_VALUE = 10 ** 15
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        out = -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        out = _OPS[type(node.op)](left, right)
    else:
        raise ValueError("only numbers and + - * / ( ) are allowed")
    if abs(out) > MAX_VALUE:
        raise ValueError(f"a value is too large (over {MAX_VALUE:.0e})")
    return out


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. 13*15-7
    """
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is too long (over {MAX_CHARS} characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("only numbers and + - * / ( ) are allowed") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


TOOLS = Toolbox(calc, timeout_s=2.0, max_chars=100)


async def solve(row: dict, client) -> AgentResult:
    """Ask the problem; run each calculator call and ask again; grade the last reply."""
    messages = list(row["messages"])
    calls = 0
    while True:   # rollout.max_turns bounds the completions (EpisodeLimit ends the episode)
        reply = (await client.chat.completions.create(messages=messages, tools=TOOLS.schemas)).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            break
        calls += len(reply.tool_calls)
        messages += await TOOLS.run_all(reply)
    verdict = await client.grade(reply.content or "")
    return AgentResult(verdict.reward, correct=verdict.correct, details={"tool_calls": calls})
