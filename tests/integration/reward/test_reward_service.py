"""The reward service as a real process: concurrent clients, a killed and a hung grader worker,
deadlines, bad requests. Every request is answered and the service keeps serving."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from reward_service_helpers import slow_item, wait_no_sandbox_processes

from tandem.services.protocol import GradeItem, GradeRequest, RemoteError, RequestClient


def math_item(response: str, answer: str) -> GradeItem:
    return GradeItem(task="math", response=response, answer=answer)


def test_concurrent_clients_get_their_own_verdicts(reward_service):
    async def one_client(k: int) -> list[tuple[bool, bool]]:
        client = RequestClient(reward_service.keys, reward_service.address, timeout_s=60)
        try:
            seen = []
            for r in range(4):
                items = [math_item(f"\\boxed{{{k * 100 + r * 10 + i}}}", str(k * 100 + r * 10 + (i % 2) * i))
                         for i in range(3)]
                reply = await client.request(GradeRequest(items=items, deadline_s=50))
                seen += [(v.correct, i != 2) for i, v in enumerate(reply.verdicts)]
            return seen
        finally:
            client.close()

    async def main():
        return await asyncio.gather(*(one_client(k) for k in range(6)))

    for seen in asyncio.run(main()):
        assert len(seen) == 12
        for got, expected in seen:
            assert got == expected


def test_mixed_batch_math_and_code(reward_service):
    items = [math_item(r"\boxed{\frac{1}{2}}", "0.5"),
             GradeItem(task="code", response="```python\nprint(int(input()) * 2)\n```",
                       tests={"inputs": ["2\n", "5\n"], "outputs": ["4", "10"]}),
             GradeItem(task="code", response="def f(x): return x", tests={"inputs": [], "outputs": []}),
             math_item(r"\boxed{3}", "4")]
    c = reward_service.client()
    try:
        v = c.request(GradeRequest(items=items, deadline_s=50)).verdicts
    finally:
        c.close()
    assert [x.correct for x in v] == [True, True, False, False]
    assert "invalid tests" in v[2].details["reason"]


def _kill_soon(pid: int, sig: int, delay_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), os.kill(pid, sig)), daemon=True)
    t.start()
    return t


def test_killed_worker_is_replaced_and_its_item_answered(reward_service):
    before = reward_service.status()
    victim = before["workers"][0]
    # Six slow items keep both workers busy for ~3 s; the victim dies in the middle. (Distinct
    # items: identical ones would be graded once, reward/verdict_cache.py.)
    items = [slow_item(k) for k in range(6)] + [math_item(r"\boxed{7}", "7")]
    _kill_soon(victim, signal.SIGKILL, 0.3)
    c = reward_service.client()
    try:
        verdicts = c.request(GradeRequest(items=items, deadline_s=50)).verdicts
    finally:
        c.close()
    assert len(verdicts) == 7
    crashed = [v for v in verdicts if "crashed" in v.details.get("error", "")]
    assert len(crashed) == 1 and crashed[0].reward == -5.0
    # The other slow items hit their own time limit: a verdict, not an error.
    timed_out = [v for v in verdicts[:6] if "error" not in v.details]
    assert len(timed_out) == 5 and all(v.details["reason"].endswith("first failure: timeout") for v in timed_out)
    assert verdicts[-1].correct
    after = reward_service.status()
    assert victim not in after["workers"] and len(after["workers"]) == 2
    assert after["restarts"] == before["restarts"] + 1
    # And the new worker grades.
    c = reward_service.client()
    try:
        again = c.request(GradeRequest(items=[math_item(r"\boxed{5}", "5")] * 4, deadline_s=50)).verdicts
    finally:
        c.close()
    assert all(v.correct for v in again)


def test_hung_worker_is_killed_and_replaced(reward_service):
    before = reward_service.status()
    victim = before["workers"][1]
    os.kill(victim, signal.SIGSTOP)  # a grader stuck where no timer of its own can help
    try:
        c = reward_service.client()
        try:
            items = [math_item(rf"\boxed{{{k}}}", str(k)) for k in range(2, 6)]   # four distinct jobs
            verdicts = c.request(GradeRequest(items=items, deadline_s=50),
                                 timeout_s=60).verdicts
        finally:
            c.close()
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    hung = [v for v in verdicts if "hung" in v.details.get("error", "")]
    assert len(hung) == 1
    assert sum(v.correct for v in verdicts) == 3
    after = reward_service.status()
    assert victim not in after["workers"] and len(after["workers"]) == 2


def test_request_deadline_answers_in_time(reward_service):
    items = [slow_item(k) for k in range(12)]
    c = reward_service.client()
    t0 = time.monotonic()
    try:
        verdicts = c.request(GradeRequest(items=items, deadline_s=1.0), timeout_s=30).verdicts
    finally:
        c.close()
    assert time.monotonic() - t0 < 10  # answered at its deadline, not after grading all twelve
    assert len(verdicts) == 12
    assert any("deadline" in v.details.get("error", "") for v in verdicts)
    assert all(v.reward == -5.0 for v in verdicts)
    # Expired items are skipped, not graded late: the pool is free again soon.
    c = reward_service.client()
    try:
        ok = c.request(GradeRequest(items=[math_item(r"\boxed{1}", "1")], deadline_s=30)).verdicts
    finally:
        c.close()
    assert ok[0].correct


def test_bad_requests_are_rejected_and_the_service_goes_on(reward_service):
    c = reward_service.client()
    try:
        with pytest.raises(RemoteError) as e:
            c.request(GradeRequest(items=[], deadline_s=0))
        assert e.value.code == "rejected"
        assert c.request(GradeRequest(items=[], deadline_s=5)).verdicts == []
        assert c.request(GradeRequest(items=[math_item(r"\boxed{1}", "1")])).verdicts[0].correct
    finally:
        c.close()
    assert wait_no_sandbox_processes() == []


def test_worker_dying_while_idle_costs_no_verdict(reward_service):
    before = reward_service.status()
    victim = before["workers"][0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while victim in reward_service.status()["workers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    c = reward_service.client()
    try:
        verdicts = c.request(GradeRequest(items=[math_item(r"\boxed{9}", "9")] * 6, deadline_s=50)).verdicts
    finally:
        c.close()
    assert all(v.correct for v in verdicts), [v.details for v in verdicts]
    after = reward_service.status()
    assert victim not in after["workers"] and len(after["workers"]) == 2
    assert after["restarts"] == before["restarts"] + 1


def test_sigterm_stops_the_service_and_its_workers(tmp_path):
    from reward_service_helpers import REWARD_OVERRIDES, start_service, stop_service
    svc = start_service(tmp_path / "exp", REWARD_OVERRIDES)
    workers = svc.status()["workers"]
    stop_service(svc)
    assert svc.proc.returncode == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)


def test_the_question_reaches_the_grader(reward_service):
    """Options and a percent asked for are read from `GradeItem.question` inside the service's
    worker processes, as in the grader called directly."""
    options = r"Which is prime? $\textbf{(A) }4\qquad\textbf{(B) }7$"
    items = [GradeItem(task="math", response=r"\boxed{7}", answer="B", question=options),
             GradeItem(task="math", response=r"\boxed{7}", answer="B"),
             GradeItem(task="math", response=r"\boxed{0.25}", answer=r"25\%", question="What percent of 8 is 2?"),
             GradeItem(task="math", response=r"\boxed{0.25}", answer=r"25\%")]

    async def main():
        client = RequestClient(reward_service.keys, reward_service.address, timeout_s=60)
        try:
            return (await client.request(GradeRequest(items=items, deadline_s=50))).verdicts
        finally:
            client.close()

    verdicts = asyncio.run(main())
    assert [v.correct for v in verdicts] == [True, False, False, True]
    assert "option (B)" in verdicts[0].details["source"]
