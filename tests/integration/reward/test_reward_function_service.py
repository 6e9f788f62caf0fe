"""`reward.function` in a real reward service: the user's function runs in the grader workers
and gets the prompt, the response and the data set's row as the rollout sends them; whatever a
response makes it do — return NaN, 1e308 or a bool, raise, print, overrun its time in Python or
in code deaf to the timer, kill its worker — the item comes back with wrong_reward and a reason,
the service keeps serving, and the counts (`user_graded`, `user_refused`) say so in the status
and in metrics.jsonl. Identical items reach the function once (the verdict cache). A function
that does not import stops the service at start, naming reward.function."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reward_service_helpers import start_service, stop_service

from tandem.rollout.dataset import Prompt
from tandem.rollout.workflow import grade_item
from tandem.services.protocol import GradeItem, GradeRequest, read_metrics

SUPPORT = str(Path(__file__).parents[2] / "support")
OVERRIDES = ["reward.num_workers=2", "reward.function_timeout_s=1.0", "reward.function=reward_fns:dispatch"]


def _env(tmp: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")])),
            "TANDEM_TEST_REWARD_CALLS": str(tmp / "calls.txt")}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fn")
    svc = start_service(tmp / "exp", OVERRIDES, env=_env(tmp))
    svc.calls = tmp / "calls.txt"
    yield svc
    stop_service(svc)


def _grade(svc, items, deadline_s=60.0):
    c = svc.client()
    try:
        return c.request(GradeRequest(items=items, deadline_s=deadline_s), timeout_s=90).verdicts
    finally:
        c.close()


def test_the_function_gets_prompt_response_and_the_rollouts_row(service):
    # the data set row's other columns (Prompt.row) reach the function too
    math_prompt = Prompt("gsm-7", "What is 6 * 7?", "math", {"answer": "42"}, row={"source": "gsm8k", "level": 2})
    code_tests = {"inputs": ["1\n"], "outputs": ["1"]}
    code_prompt = Prompt("cc-3", "Echo the input.", "code", {"tests": code_tests, "visible_tests": code_tests})
    v_math, v_code = _grade(service, [grade_item(math_prompt, "mirror math"), grade_item(code_prompt, "mirror code")])
    assert (v_math.reward, v_math.correct) == (2.5, True)     # above the middle of [-5, 5]
    assert v_math.details["grader"] == "function" and v_math.details["source"] == "reward_fns:dispatch"
    assert v_math.details["reason"] == "mirrored"
    assert v_math.details["user"]["prompt"] == "What is 6 * 7?"
    assert v_math.details["user"]["row"] == {"source": "gsm8k", "level": 2, "id": "gsm-7", "answer": "42"}
    # a code row's tests travel once (in the item's own field) and are put back into the row
    assert v_code.details["user"]["row"] == {"id": "cc-3", "visible_tests": code_tests, "tests": code_tests}
    assert v_code.details["user"]["prompt"] == "Echo the input."


@pytest.mark.parametrize("response, why, error", [
    ("nan", "returned nan, not a finite number", False),
    ("huge", "returned 1e+308, outside [wrong_reward, correct_reward] = [-5, 5]", False),
    ("bool", "returned True, a bool", False),
    ("raise", "reward.function raised KeyError: 'no such field'", False),
    ("sleep", "timeout: reward.function took over 1s", True),
])
def test_what_a_response_can_make_the_function_do_earns_wrong_reward(service, response, why, error):
    before = service.status()
    v = _grade(service, [GradeItem(task="math", response=f"{response} {id(why)}", answer="1")])[0]
    assert (v.reward, v.correct) == (-5.0, False)
    assert v.details["refused"] is True and why in v.details["reason"], v.details
    assert ("error" in v.details) == error
    after = service.status()
    assert after["user_graded"] == before["user_graded"] + 1
    assert after["user_refused"] == before["user_refused"] + 1
    assert after["restarts"] == before["restarts"]            # the worker went on


def test_a_worker_the_function_kills_or_blocks_is_replaced(service):
    before = service.status()
    crashed, blocked, fine = _grade(service, [GradeItem(task="math", response="exit now", answer="1"),
                                              GradeItem(task="math", response="block now", answer="1"),
                                              GradeItem(task="math", response="print then mirror", answer="1")])
    assert crashed.reward == -5.0 and "grader worker crashed" in crashed.details["error"]
    # deaf to the worker's timer: killed by the pool at function_timeout_s + 5 s
    assert blocked.reward == -5.0 and "grader hung: killed after 6s" in blocked.details["error"]
    assert fine.reward == 2.5     # printing to stdout did not garble the worker's reply stream
    after = service.status()
    assert after["restarts"] == before["restarts"] + 2 and after["errors"] == before["errors"] + 2
    assert _grade(service, [GradeItem(task="math", response="mirror again", answer="1")])[0].reward == 2.5


def test_identical_items_reach_the_function_once(service):
    item = GradeItem(task="math", response="mirror once", answer="3", row={"id": "r1"})
    other_row = GradeItem(task="math", response="mirror once", answer="3", row={"id": "r2"})
    verdicts = _grade(service, [item] * 4 + [other_row])
    assert [v.reward for v in verdicts] == [2.5] * 5
    assert _grade(service, [item])[0].details == verdicts[0].details
    lines = service.calls.read_text().splitlines()
    assert lines.count("mirror once") == 2      # one per distinct row: the row is part of the item


def test_the_counts_reach_metrics_when_the_service_stops(tmp_path):
    svc = start_service(tmp_path / "exp", OVERRIDES, env=_env(tmp_path))
    try:
        assert svc.status()["grader"] == "function reward_fns:dispatch"
        _grade(svc, [GradeItem(task="math", response="mirror", answer="1"),
                     GradeItem(task="math", response="nan", answer="1")])
    finally:
        stop_service(svc)
    last = read_metrics(svc.exp, "reward", "reward")[-1]     # written at shutdown, however short the run
    assert (last["graded"], last["user_graded"], last["user_refused"]) == (2, 2, 1)


def test_an_async_function_is_awaited_in_the_workers(tmp_path):
    svc = start_service(tmp_path / "exp", [*OVERRIDES, "reward.function=reward_fns:async_dispatch"],
                        env=_env(tmp_path))
    try:
        ok, bad = _grade(svc, [GradeItem(task="math", response="mirror", answer="1"),
                               GradeItem(task="math", response="nan", answer="1")])
        assert ok.reward == 2.5 and bad.details["refused"]
    finally:
        stop_service(svc)


def test_a_function_that_does_not_import_stops_the_service_at_start(tmp_path):
    with pytest.raises(RuntimeError) as e:
        start_service(tmp_path / "exp", [*OVERRIDES, "reward.function=reward_fns:nothing_here"], env=_env(tmp_path))
    assert "reward.function 'reward_fns:nothing_here': module 'reward_fns' has no attribute 'nothing_here'" \
        in str(e.value)


def test_offline_grading_gives_the_function_each_input_row(tmp_path, monkeypatch, capsys):
    from tandem.reward.config import RewardConfig
    from tandem.reward.offline import grade_file

    for key, value in _env(tmp_path).items():
        monkeypatch.setenv(key, value)      # the pool's workers inherit it
    rows = [{"id": 1, "response": "mirror", "answer": 7, "level": "easy", "problem": "3 + 4?"},
            {"id": 2, "response": "nan", "answer": "1"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RewardConfig(num_workers=1, function="reward_fns:dispatch", function_timeout_s=2.0)
    assert grade_file("math", src, tmp_path / "out.jsonl", cfg, quiet=True) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out[0]["reward"] == 2.5 and out[0]["details"]["user"]["prompt"] == "3 + 4?"
    # the row as written (its answer still a number), less the response
    assert out[0]["details"]["user"]["row"] == {"id": 1, "answer": 7, "level": "easy", "problem": "3 + 4?"}
    assert out[1]["reward"] == -5.0 and out[1]["details"]["refused"]
    assert "2 graded, 1 correct" in capsys.readouterr().out


def test_an_agents_program_runs_in_the_sandbox_never_through_the_function(service):
    """`task: run` (an agent's code tool, reward/code_runner.py): the program runs once in the code
    sandbox with its stdin and what it printed comes back; what it does wrong is its status. The
    user's function, which grades answers, never sees it."""
    before = len(service.calls.read_text().splitlines()) if service.calls.exists() else 0
    add, loops, peeks, floods = _grade(service, [
        GradeItem(task="run", response="import sys\nprint(sum(map(int, sys.stdin.read().split())))", answer="2 3"),
        GradeItem(task="run", response="while True:\n    pass"),
        GradeItem(task="run", response="print(open('/etc/shadow').read())"),
        GradeItem(task="run", response="print('x' * 100000)"),
    ])
    assert (add.correct, add.details["status"], add.details["stdout"]) == (True, "ok", "5\n"), add.details
    assert not loops.correct and "time" in loops.details["status"], loops.details
    assert not peeks.correct and peeks.details["status"].startswith("runtime error"), peeks.details
    assert "Error" in peeks.details["stderr"] and "root:" not in peeks.details["stdout"], peeks.details
    assert floods.correct and floods.details["stdout"] == "x" * 4000, len(floods.details["stdout"])
    after = len(service.calls.read_text().splitlines()) if service.calls.exists() else 0
    assert after == before
