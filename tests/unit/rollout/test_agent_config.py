"""What `tandem config check` says of `rollout.agent` and its settings, before anything starts."""
from __future__ import annotations

import pytest

from tandem.launcher.preflight import agent_problem
from tandem.rollout.config import RolloutConfig

AGENTS = '''
async def good(row, client):
    return 1.0

def not_async(row, client):
    return 1.0

async def one_argument(row):
    return 1.0
'''


@pytest.mark.parametrize("spec, problem", [
    ("my_agents:good", None),
    ("my_agents:not_async", "my_agents:not_async must be an async function (async def not_async(row, client))"),
    ("my_agents:one_argument", "my_agents:one_argument must take two arguments, (row, client)"),
    ("my_agents:missing", "my_agents has no function 'missing'"),
    ("no_such_module:solve", "cannot import 'no_such_module' (No module named 'no_such_module')"),
    ("my_agents", "must look like 'module:function', got 'my_agents'"),
])
def test_the_agent_is_imported_as_the_workers_will(tmp_path, monkeypatch, spec, problem):
    (tmp_path / "my_agents.py").write_text(AGENTS)
    monkeypatch.chdir(tmp_path)        # roles import the user's code from the launch directory
    monkeypatch.syspath_prepend(str(tmp_path))
    assert agent_problem(spec) == problem


def test_agent_settings_are_checked():
    problems = dict(RolloutConfig(agent="a:b", workflow="x:y", agent_timeout_s=0, agent_context_tokens=-1,
                                  tool_call_format="json").problems())
    assert problems["agent"] == "replaces the workflow: leave rollout.workflow out (it is 'x:y')"
    assert problems["agent_timeout_s"] == "must be > 0"
    assert problems["agent_context_tokens"].startswith("must be >= 0")
    assert problems["tool_call_format"] == 'must be one of hermes, llama3, mistral or "" (from the chat template), ' \
                                           "got 'json'"
    assert RolloutConfig(agent="a:b").problems() == []
