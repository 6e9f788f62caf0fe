"""A group whose prompt is longer than `rollout.max_prompt_tokens` is rejected by its worker, never
sent: with `rollout.max_new_tokens` that bound is what the config check holds
`trainer.max_tokens_per_mb` to, so a longer sample would be dropped by the trainer (too_long).
No processes: the worker's episode method around stand-ins for the workflow, sink and controller."""
from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import numpy as np

from tandem.rollout.worker import RolloutWorker
from tandem.services.protocol import Ticket, Trajectory


def _trajectory(prompt_len: int) -> Trajectory:
    return Trajectory(group_id="g", sample_idx=0, group_size=1, prompt_ids=np.ones(prompt_len, np.int32),
                      output_ids=np.ones(3, np.int32), output_logprobs=np.zeros(3, np.float32),
                      output_versions=np.zeros(3, np.int32), admit_version=0, reward=1.0, finish_reason="stop",
                      task="math", timings={})


def _run(prompt_len: int, limit: int, text: str = "1+1"):
    w = RolloutWorker.__new__(RolloutWorker)
    w.rc, w.rank = SimpleNamespace(max_prompt_tokens=limit), 3
    sent, reports, settled = [], [], []

    async def workflow(ctx, prompt, ticket):
        return [_trajectory(prompt_len)]

    async def send_group(trajectories, on_receipted):
        sent.append(trajectories)

    async def report(done):
        reports.append(done)

    w.workflow = workflow
    w.sink = SimpleNamespace(send_group=send_group)
    w.data = SimpleNamespace(settle=lambda index, failed=False: settled.append((index, failed)))
    w.running, w.counts, w._report, w.worker_id = {}, Counter(), report, "w0"
    w._record_group = lambda *a: None
    asyncio.run(w._episode(None, 7, SimpleNamespace(id="p", text=text), Ticket(group_id="g", admit_version=0)))
    return sent, reports, settled, w.counts


def test_a_prompt_longer_than_the_limit_is_rejected_not_sent():
    sent, reports, settled, counts = _run(prompt_len=9, limit=8)
    assert sent == [] and counts == {"rejected": 1}
    assert reports[0].status == "rejected" and "rollout.max_prompt_tokens=8" in reports[0].reason
    assert "9 tokens" in reports[0].reason
    assert settled == [(7, False)]      # the prompt is used up, not given back to be drawn again


def test_a_prompt_at_the_limit_is_sent():
    sent, reports, _, counts = _run(prompt_len=8, limit=8)
    assert len(sent) == 1 and counts == {"accepted": 1} and reports[0].status == "accepted"
    assert [t.prompt_key for t in sent[0]] == ["3:7"]   # worker 3's prompt 7: trained once


def test_a_problem_too_long_for_any_prompt_is_rejected_before_it_is_tokenized():
    """Two 20 MB rows once held a worker's event loop in the tokenizer until its leases expired.
    (The stand-in workflow would accept any problem: the rejection comes before it.)"""
    sent, reports, settled, counts = _run(prompt_len=1, limit=8, text="x" * (8 * 64 + 1))
    assert sent == [] and counts == {"rejected": 1} and settled == [(7, False)]
    assert "a problem of 513 characters cannot fit rollout.max_prompt_tokens=8" in reports[0].reason
    assert _run(prompt_len=1, limit=8, text="x" * (8 * 64))[3] == {"accepted": 1}
