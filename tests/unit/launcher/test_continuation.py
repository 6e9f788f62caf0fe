"""The automatic continuation's decisions (launcher/continuation.py), without processes or SLURM:
which job ends continue, the back-off, the same-failure-twice rule, the budget, what is recorded
and said, and how the report labels each continuation. The cluster runs of the same policy are
tests/integration/slurm/test_slurm_continuation.py."""
from __future__ import annotations

import json

import pytest

from tandem.launcher.backends import RoleFailed
from tandem.launcher.backends.base import Backend, Ended, LaunchError
from tandem.launcher.backends.slurm import no_requeue, requeued_launcher
from tandem.launcher.continuation import (
    CONTINUED,
    NOT_CONTINUED,
    Failure,
    backoff_s,
    continuations,
    decide,
    keep_going,
    requeue_own_job,
)
from tandem.launcher.roles import Role
from tandem.launcher.run_info import RunInfo
from tandem.launcher.slurm_jobs import cancel_flag, write_record
from tandem.services.protocol.runtime import MetricsWriter


@pytest.mark.parametrize("cause", ["TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL"])
def test_the_clusters_ends_continue(cause):
    v = decide(Failure("trainer-0", cause, 4, "77"), [], budget=3, base_s=60)
    assert v.go and v.attempt == 1 and v.wait_s == 60
    assert "trainer-0 (job 77)" in v.why and "at step 4" in v.why


@pytest.mark.parametrize("cause", ["FAILED", "OUT_OF_MEMORY", "CANCELLED", "DEADLINE", ""])
def test_the_runs_own_ends_do_not(cause):
    v = decide(Failure("trainer-0", cause, 4), [], budget=3, base_s=60)
    assert not v.go and "not the cluster's doing" in v.why


def test_an_end_that_was_no_roles_is_not_continued():
    assert not decide(None, [], budget=3, base_s=60).go


def test_the_back_off_doubles_up_to_sixteen_times_the_first():
    assert [backoff_s(a, 10) for a in range(1, 8)] == [10, 20, 40, 80, 160, 160, 160]
    f = [Failure("trainer-0", "TIMEOUT", s) for s in (1, 2, 3)]
    assert decide(f[2], f[:2], budget=5, base_s=10).wait_s == 40


def test_the_same_failure_twice_in_a_row_at_the_same_step_stops():
    first = Failure("trainer-0", "TIMEOUT", 6)
    v = decide(Failure("trainer-0", "TIMEOUT", 6), [first], budget=3, base_s=1)
    assert not v.go and "failed the same way twice in a row at the same step" in v.why
    # Progress in between, another state, or another role: not the same failure.
    assert decide(Failure("trainer-0", "TIMEOUT", 7), [first], 3, 1).go
    assert decide(Failure("trainer-0", "NODE_FAIL", 6), [first], 3, 1).go
    assert decide(Failure("gen-0", "TIMEOUT", 6), [first], 3, 1).go
    # "In a row": the same failure with another one between them is no loop.
    assert decide(first, [first, Failure("trainer-0", "NODE_FAIL", 6)], 3, 1).go


def test_the_budget_bounds_the_continuations():
    history = [Failure("trainer-0", "TIMEOUT", s) for s in (1, 2)]
    v = decide(Failure("trainer-0", "TIMEOUT", 3), history, budget=2, base_s=1)
    assert not v.go and "already continued 2 times (launcher.slurm.auto_resume = 2)" in v.why


class _Ended(Backend):
    """A backend whose launch ended as given (only `failure` is read)."""
    def __init__(self, failure):
        self.failure = failure
    pick_port = start = ended = run_to_end = stop = close = None


def _failed(cause: str, role: str = "trainer-0", job: str = "10") -> _Ended:
    end = Ended(Role(role, ["x"], kind=role.split("-")[0]), ok=False, why="...", cause=cause, job_id=job)
    return _Ended(RoleFailed(f"{role} failed", end))


def _trained(exp, *steps):
    w = MetricsWriter(exp, "trainer")
    for s in steps:
        w.log(event="step", step=s)
    w.close()


def test_keep_going_resumes_until_the_run_finishes_and_records_each_continuation(exp, capsys):
    write_record(exp, {"status": "failed", "roles": {}})
    _trained(exp, 1, 2)
    launches = iter([(1, _failed("NODE_FAIL", job="11")), (0, _Ended(None))])
    calls = []

    def relaunch():
        calls.append(1)
        code, backend = next(launches)
        if code:
            _trained(exp, 3)
        return code, backend, exp

    waits = []
    assert keep_going(1, _failed("TIMEOUT"), exp, budget=3, base_s=0.0, relaunch=relaunch, sleep=waits.append) == 0
    assert len(calls) == 2
    recs = continuations(exp)
    assert [(r["event"], r["cause"], r["step"], r["attempt"], r["job_id"]) for r in recs] == [
        (CONTINUED, "TIMEOUT", 2, 1, "10"), (CONTINUED, "NODE_FAIL", 3, 2, "11")]
    out = capsys.readouterr().out
    assert "trainer-0 (job 10) reached its time limit (TIMEOUT) at step 2: continuing the run" in out
    assert "automatic continuation 2 of 3" in out


def test_keep_going_stops_at_the_same_failure_twice_and_says_so(exp, capsys):
    write_record(exp, {"status": "failed", "roles": {}})
    _trained(exp, 1, 2)
    relaunched = []

    def relaunch():
        relaunched.append(1)
        return 1, _failed("TIMEOUT", job="12"), exp

    assert keep_going(1, _failed("TIMEOUT"), exp, budget=3, base_s=0.0, relaunch=relaunch) == 1
    assert len(relaunched) == 1
    last = continuations(exp)[-1]
    assert last["event"] == NOT_CONTINUED and last["step"] == 2 and last["job_id"] == "12"
    assert "failed the same way twice in a row at the same step" in capsys.readouterr().err


def test_keep_going_does_nothing_when_off_or_after_a_success(exp):
    def relaunch():
        raise AssertionError("must not relaunch")
    assert keep_going(1, _failed("TIMEOUT"), exp, budget=0, base_s=0.0, relaunch=relaunch) == 1
    assert keep_going(0, _Ended(None), exp, budget=3, base_s=0.0, relaunch=relaunch) == 0
    assert keep_going(130, _Ended(LaunchError("x")), exp, budget=3, base_s=0.0, relaunch=relaunch) == 130
    assert continuations(exp) == []


def test_a_cancel_during_the_back_off_stops_the_continuation(exp, capsys):
    write_record(exp, {"status": "failed", "roles": {}})

    def cancel_while_waiting(seconds):
        cancel_flag(exp).write_text("now\n")

    def relaunch():
        raise AssertionError("must not relaunch")
    assert keep_going(1, _failed("PREEMPTED"), exp, budget=3, base_s=5.0, relaunch=relaunch,
                      sleep=cancel_while_waiting) == 1
    assert "cancelled while waiting to continue" in capsys.readouterr().err
    assert json.loads((exp.services / "slurm-jobs.json").read_text())["status"] == "cancelled"


def test_the_report_labels_each_resume_by_what_made_it():
    info = RunInfo("r", resumes=[100.0, 200.0, 300.0],
                   continued=[{"time": 150.0, "attempt": 1, "cause": "TIMEOUT"},
                              {"time": 290.0, "attempt": 2, "cause": "NODE_FAIL"}])
    assert info.resume_labels() == ["resumed", "continued #1: TIMEOUT", "continued #2: NODE_FAIL"]
    assert "resumed 3x (2 by the launcher itself)" in info.subtitle()


def test_jobs_are_not_requeued_by_slurm_unless_the_experiment_asks():
    assert no_requeue({}) == {"no_requeue": True}
    assert no_requeue({"mail-type": "END"}) == {"no_requeue": True, "mail-type": "END"}
    assert no_requeue({"requeue": True}) == {"requeue": True}
    assert no_requeue({"no_requeue": True}) == {"no_requeue": True}


class _Scontrol:
    def __init__(self, rc=0, err=""):
        self.calls, self.rc, self.err = [], rc, err

    def __call__(self, cmd, **kw):
        import subprocess
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.rc, "", self.err)


def test_the_launchers_job_requeues_itself_within_the_budget(exp, capsys):
    write_record(exp, {"status": "interrupted", "roles": {}})
    _trained(exp, 1, 2, 3)
    scontrol = _Scontrol()
    assert requeue_own_job(exp, 3, env={"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "1"}, run=scontrol,
                           sleep=lambda s: None) == 0
    assert scontrol.calls == [["scontrol", "requeue", "900"]]
    (rec,) = continuations(exp)
    assert (rec["event"], rec["failed_role"], rec["cause"], rec["step"], rec["attempt"]) == (
        CONTINUED, "launcher", "TIMEOUT", 3, 2)
    assert "launcher (job 900) reached its time limit (TIMEOUT) at step 3: requeueing job 900" in capsys.readouterr().out
    assert json.loads((exp.services / "slurm-jobs.json").read_text())["status"] == "requeued launcher job 900"


@pytest.mark.parametrize("env,said", [({"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "3"},
                                       "its job was already requeued 3 times (launcher.slurm.auto_resume = 3)"),
                                      ({}, "but it runs in no SLURM job to requeue")])
def test_the_launchers_job_is_not_requeued_past_the_budget_or_outside_slurm(exp, capsys, env, said):
    scontrol = _Scontrol()
    assert requeue_own_job(exp, 3, env=env, run=scontrol, sleep=lambda s: None) == 130
    assert scontrol.calls == [] and continuations(exp)[-1]["event"] == NOT_CONTINUED
    assert said in capsys.readouterr().err


def test_a_refused_requeue_says_what_the_job_lacks(exp, capsys):
    scontrol = _Scontrol(rc=1, err="Requeue of JobId=900 not allowed")
    assert requeue_own_job(exp, 3, env={"SLURM_JOB_ID": "900"}, run=scontrol, sleep=lambda s: None) == 1
    assert "scontrol requeue 900 failed: Requeue of JobId=900 not allowed (is the job submitted with --requeue" \
        in capsys.readouterr().err


def test_only_a_requeued_run_of_the_same_launcher_job_takes_over_the_jobs_on_record(exp):
    """The jobs of a launcher whose own job SLURM requeued (its node lost) are cancelled by the
    next run of that job instead of refusing the launch; anyone else's are not."""
    write_record(exp, {"status": "running", "roles": {}, "launcher_job": "900"})
    assert requeued_launcher(exp, {"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "1"})
    assert not requeued_launcher(exp, {"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "0"})
    assert not requeued_launcher(exp, {"SLURM_JOB_ID": "901", "SLURM_RESTART_COUNT": "1"})
    assert not requeued_launcher(exp, {})
    write_record(exp, {"status": "running", "roles": {}, "launcher_job": None})
    assert not requeued_launcher(exp, {"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "1"})


def test_a_job_whose_role_the_time_limit_warning_stopped_ended_by_its_time_limit(exp):
    """SLURM records such a job FAILED (the wrapper fails its task); the note any of its tasks
    leaves (slurm_task.time_limit_note) makes it TIMEOUT for the launcher, and says so."""
    from tandem.launcher.backends.slurm import SlurmRun, Submitted
    from tandem.launcher.backends.slurm_requests import JobRequest, SlurmPolicy
    from tandem.launcher.config import load_config
    from tandem.launcher.slurm_jobs import JobState
    from tandem.launcher.slurm_task import time_limit_note
    from tandem.services.protocol import write_json_atomic

    cfg = load_config(None, ["experiment.name=t", "experiment.model=/nonexistent", f"experiment.exp_dir={exp.root}",
                             "launcher.backend=slurm", "launcher.slurm.launcher_lease_s=0"])
    run = SlurmRun(cfg, exp, SlurmPolicy(launcher_lease_s=0))
    run.jobs["trainer-0"] = Submitted(JobRequest(Role("trainer-0", ["x"], kind="trainer"), nodes=2), "55")
    failed = JobState("55", "FAILED", exit_code="1:0", nodes="n[1-2]")
    assert run.cause("trainer-0", failed) == "FAILED"
    write_json_atomic(time_limit_note(run.folder, "55", 1), {"signal": "SIGUSR2"})   # rank 1's note
    end = run.end_of("trainer-0", failed)
    assert (end.cause, end.job_id, end.ok) == ("TIMEOUT", "55", False)
    assert "trainer-0 (job 55) stopped at its time limit by SLURM's warning (sacct: FAILED, exit code 1:0" in end.why
    assert run.cause("trainer-0", JobState("55", "NODE_FAIL")) == "NODE_FAIL"
    assert run.cause("trainer-0", JobState("56", "FAILED")) == "FAILED"   # another job's note is not its
