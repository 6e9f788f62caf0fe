"""A multi-turn code agent written against the OpenAI API:
`rollout.agent: tandem.rollout.agents.code_feedback:solve`.

The environment of the built-in workflow `tandem.rollout.code_feedback:code_with_feedback`, as a
user would write it as an agent: the model writes a program; the environment runs it in the
reward sandbox on the problem's visible examples (followed by the hidden tests, whose results
it never shows); while a visible example fails and turns remain, the first failure comes back as
the next user message and the model revises. Each program's verdict on every test is its turn's
reward; the episode's is the last program's. Nothing here knows about tokens: the client records
them, and on the same samples this agent's trajectories are the workflow's, token for token
(tests/unit/rollout/test_agent_equivalence.py) — so the workflow's recorded learning on this
machine (benchmarks/results/train_code_agent.json) is this agent's.
"""
from __future__ import annotations

from tandem.rollout.agent import AgentResult
from tandem.rollout.agent_client import EpisodeLimit
from tandem.rollout.code_feedback import checked_tests, feedback_message, visible_passed

FEEDBACK_CHARS = 300   # as rollout.feedback_chars' default


async def solve(row: dict, client) -> AgentResult:
    visible = row.get("visible_tests")
    tests, n_visible = checked_tests(visible, row["tests"])
    messages = list(row["messages"])
    verdicts = []
    try:
        while True:
            reply = (await client.chat.completions.create(messages=messages)).choices[0].message
            verdicts.append(await client.grade(reply.content, tests=tests))
            if not n_visible or visible_passed(verdicts[-1], n_visible):
                break
            messages += [reply, {"role": "user", "content": feedback_message(visible, verdicts[-1], FEEDBACK_CHARS)}]
    except EpisodeLimit:   # out of turns (rollout.max_turns) or context: the last program stands
        pass
    last = verdicts[-1]
    return AgentResult(last.reward, correct=last.correct, turn_rewards=[v.reward for v in verdicts],
                       details={"first_turn_correct": float(verdicts[0].correct)})
