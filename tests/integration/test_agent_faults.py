"""Faults during an agent run (rollout.agent): nothing lost, nothing trained twice (issue 64).

The fault suite's run (benchmarks/faults.py: the local backend, every role a real process) with an
agent of the test's own, launched from the directory its module is in: each episode asks the
model, then calls a tool that hangs (the Toolbox's time-out answers for it), then asks again
with the tool's error in its context — two completions and the template's tokens between them,
as a tool-using agent's episode is. Injected in turn: SIGKILL of the generation server (episodes
are mid-way: their next completion goes to the restarted server) and SIGKILL of the trainer,
continued with `--resume`. The accounting is the run's own (`tandem audit`).
"""
from __future__ import annotations

import pytest

from benchmarks.faults import run_with_faults

pytestmark = pytest.mark.timeout(600)

AGENT = '''
import time
from pathlib import Path

import tandem


def stall(query: str) -> str:
    """A tool that never answers in time.

    Args:
        query: anything
    """
    time.sleep(5)
    return "too late"


TOOLS = tandem.Toolbox(stall, timeout_s=0.3)


async def solve(row, client):
    messages = list(row["messages"])
    first = await client.chat.completions.create(messages=messages, max_tokens=16)
    call = {"id": "call_0", "type": "function", "function": {"name": "stall", "arguments": '{"query": "x"}'}}
    answer = await TOOLS.run(call)
    Path("tool-answers.txt").open("a").write(answer["content"] + "\\n")
    messages += [first.choices[0].message, answer]
    second = await client.chat.completions.create(messages=messages, max_tokens=16)
    return float(len(second.choices[0].message.content or "") % 2)
'''


def test_an_agent_run_through_faults_accounts_for_every_group(tmp_path, tiny_model_dir):
    (tmp_path / "fault_agent.py").write_text(AGENT)
    run = run_with_faults(tmp_path, tiny_model_dir, "agent-faults", [(1, "gen"), (3, "trainer")], total_steps=30,
                          timeout_s=540, tail_steps=2, rollout=", agent: 'fault_agent:solve', max_turns: 2")
    a = run["audit"]
    assert run["exits"] == [1, 0], run["outputs"][-1][-2000:]
    assert a["steps"] == run["total_steps"]
    assert run["lost"] == [] and run["trained_twice"] == [] and a["prompts_trained_twice"] == 0 \
        and a["prompts_skipped"] == 0, {k: v for k, v in run.items() if k != "outputs"}
    for fault in run["faults"]:
        assert fault["recovery_s"] is not None, fault
    answers = (tmp_path / "tool-answers.txt").read_text().splitlines()
    assert answers and set(answers) == {"error: stall did not answer within 0.3 s"}
