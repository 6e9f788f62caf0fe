"""Identical items are graded once (reward/verdict_cache.py), in a real reward service: repeats
within a request, across requests and while the first is still being graded share one sandbox
run; a different test set is a different item; an error verdict is never remembered; a shared
job keeps running for the request that can still wait for it."""
from __future__ import annotations

import asyncio

import pytest
from reward_service_helpers import REWARD_OVERRIDES, slow_item, start_service, stop_service

from tandem.services.protocol import GradeItem, GradeRequest, RequestClient

DOUBLE = "```python\nprint(int(input()) * 2)\n```"
TESTS = {"inputs": ["2\n", "5\n"], "outputs": ["4", "10"]}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("cache") / "exp", REWARD_OVERRIDES)
    yield svc
    stop_service(svc)


def _grade(svc, items, deadline_s=50.0):
    c = svc.client()
    try:
        return c.request(GradeRequest(items=items, deadline_s=deadline_s), timeout_s=60).verdicts
    finally:
        c.close()


def _counts(svc) -> tuple[int, int]:
    s = svc.status()
    return s["graded"], s["cached"]


def test_repeats_are_graded_once(service):
    graded, cached = _counts(service)
    group = [GradeItem(task="code", response=DOUBLE, tests=TESTS)] * 7 + \
            [GradeItem(task="code", response="print(input())", tests=TESTS)]
    verdicts = _grade(service, group)
    assert [v.correct for v in verdicts] == [True] * 7 + [False]
    assert verdicts[0].details == verdicts[6].details
    assert _counts(service) == (graded + 2, cached + 6)
    # the same program in a later request: remembered
    assert _grade(service, [GradeItem(task="code", response=DOUBLE, tests=TESTS)])[0].correct
    assert _counts(service) == (graded + 2, cached + 7)
    # other tests (or another answer) are another item
    other = {"inputs": ["3\n"], "outputs": ["7"]}
    assert not _grade(service, [GradeItem(task="code", response=DOUBLE, tests=other)])[0].correct
    assert _counts(service) == (graded + 3, cached + 7)


def test_an_error_verdict_is_not_remembered(service):
    blockers = [slow_item(k) for k in range(4)]
    late = GradeItem(task="math", response=r"\boxed{12}", answer="12")
    first = _grade(service, blockers + [late], deadline_s=0.5)
    assert "deadline" in first[-1].details.get("error", "")
    again = _grade(service, [late])   # a remembered verdict would be the deadline error
    assert again[0].correct and "error" not in again[0].details


def test_a_shared_job_runs_for_the_request_that_still_waits(service):
    blockers = [slow_item(k) for k in range(10, 14)]
    item = GradeItem(task="math", response=r"\boxed{34}", answer="34")

    async def main():
        clients = [RequestClient(service.keys, service.address, timeout_s=60) for _ in range(2)]
        try:
            impatient = clients[0].request(GradeRequest(items=blockers + [item], deadline_s=0.5))
            await asyncio.sleep(0.1)   # the item is queued behind the blockers
            patient = clients[1].request(GradeRequest(items=[item], deadline_s=50))
            return await asyncio.gather(impatient, patient)
        finally:
            for c in clients:
                c.close()

    impatient, patient = asyncio.run(main())
    assert "deadline" in impatient.verdicts[-1].details.get("error", "")
    assert patient.verdicts[0].correct and "error" not in patient.verdicts[0].details


def test_off_grades_every_item(tmp_path):
    svc = start_service(tmp_path / "exp", [*REWARD_OVERRIDES, "reward.verdict_cache=0"])
    try:
        verdicts = _grade(svc, [GradeItem(task="code", response=DOUBLE, tests=TESTS)] * 3)
        assert all(v.correct for v in verdicts)
        assert _counts(svc) == (3, 0)
    finally:
        stop_service(svc)
