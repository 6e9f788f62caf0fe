"""Faults during a real run: nothing stuck, nothing lost, nothing trained twice (issue 19).

One `tandem run` of the tiny experiment (local backend, every role a real process) into which
are injected, in turn: SIGKILL of the generation server, the controller, the reward service and
a rollout worker; bad input on every port (peers without keys, garbage and oversized frames,
garbage and oversized HTTP bodies); SIGKILL of the trainer, SIGKILL of the launcher (its roles
stop by themselves) and Ctrl-C of the launcher, each continued with `--resume`, as a user would
(each launch's end leaving nothing running). Each fault is injected once the run has recovered
from the previous one. The accounting comes from the run's own records (`launcher/audit.py`:
the ids each trainer step trained or dropped, the ids workers delivered and those the trainer
never receipted, the trainer's buffer at exit, the workers' data positions): every delivered
group trained, dropped, still held or returned for generation, none twice, no prompt given up;
the staleness bound kept; no stall of the order of a timeout; nothing left running. And what
the user sees: the restarted server named, the trainer's death naming `--resume`, and the last
launch continuing the run (its progress from the step it resumed at, its own work in the
summary, the earlier launches' servers forgotten).
`benchmarks/faults.py` runs the same faults one per run and prints the table.
"""
from __future__ import annotations

import json

import pytest
from local_run import leftovers, steps

from benchmarks.faults import nan_setting_refused, run_with_faults
from tandem.services.protocol import ExpDir, read_metrics

pytestmark = pytest.mark.timeout(900)

# Long enough a reward request or a report would wait on a dead service: a gap of this order
# means a client waited out a timeout instead of following the restart.
STALL_S = 60.0
# (at the earliest after step, fault); each also waits for recovery from the one before.
# A step takes about half a second here and a fault costs several (bad input alone takes
# seconds to send): the run is long enough for all of them, with room to spare. The last fault
# (Ctrl-C) is resumed to TAIL_STEPS past the last step trained, not to STEPS.
FAULTS = [(2, "gen"), (5, "controller"), (8, "reward"), (11, "rollout"), (14, "bad-input"), (17, "trainer"),
          (22, "launcher"), (27, "ctrl-c")]
STEPS = 160
TAIL_STEPS = 8


def test_every_fault_in_turn_and_the_run_accounts_for_every_group(tmp_path, tiny_model_dir):
    run = run_with_faults(tmp_path, tiny_model_dir, "faults", FAULTS, total_steps=STEPS, timeout_s=840,
                          tail_steps=TAIL_STEPS)
    a = run["audit"]
    total = run["total_steps"]
    assert total < STEPS, run["faults"]     # resumed short: the faults left room to spare
    # The trainer's death ends its launch (1), the launcher's SIGKILL its own (-9), Ctrl-C one
    # with 130; the last resume finishes.
    assert run["exits"] == [1, -9, 130, 0], run["outputs"][-1][-2000:]
    assert a["steps"] == total
    # A worker SIGKILLed between the trainer's receipts and its saving them sends that prompt
    # again: the trainer refuses the second group by its prompt key.
    assert run["lost"] == [] and run["trained_twice"] == [] and a["prompts_trained_twice"] == 0 \
        and a["prompts_skipped"] == 0, \
        {k: v for k, v in run.items() if k != "outputs"}
    for fault in run["faults"]:
        assert fault["recovery_s"] is not None, fault
        assert fault["stall_s"] < STALL_S, fault
    # The trainer's death and a terminal's Ctrl-C each end their launch with nothing left running;
    # so does the launcher's SIGKILL, its roles stopping by themselves, the trainer checkpointing.
    assert [(f["kind"], f["left_running"]) for f in run["faults"] if "left_running" in f] == \
        [("trainer", []), ("launcher", []), ("ctrl-c", [])], run["faults"]
    killed = next(f for f in run["faults"] if f["kind"] == "launcher")
    exp = ExpDir(tmp_path / "faults")
    before = max(r["step"] for r in steps(exp) if r["time"] < killed["resumed_at"])
    after = min(r["step"] for r in steps(exp) if r["time"] > killed["resumed_at"])
    saved = [r["step"] for r in read_metrics(exp, "trainer", "checkpoint")
             if killed["time"] < r["time"] < killed["resumed_at"]]
    # Its last step saved on the watch's SIGTERM, so the resume redid none.
    assert saved[-1:] == [before] and after == before + 1, (saved, before, after)
    for role in ("trainer-0", "controller-0", "rollout-0"):
        assert f"the launcher (pid {killed['launcher_pid']}) is gone" in (exp.logs / f"{role}.log").read_text(), role
    seen = next(f for f in run["faults"] if f["kind"] == "bad-input")["observed"]
    for role in ("controller", "reward", "trainer"):
        assert seen[f"{role}: stranger"] is None, seen      # no keys: nothing gets through
    for role in ("controller", "reward"):                   # members get an error reply, not silence
        assert seen[f"{role}: garbage"] == "bad_frame" and seen[f"{role}: wrong shape"] == "bad_envelope", seen
    assert seen["gen http: no key"] == 401 and seen["gen http: garbage JSON"] == 400, seen
    assert seen["gen http: oversized body"] in (413, -1) and seen["gen http: overlong text"] == 400, seen
    summary = json.loads((exp.root / "summary.json").read_text())
    assert summary["steps"] == total and summary["staleness"]["max"] <= 2
    assert leftovers(exp) == []
    assert_the_user_sees_one_run(run, exp, summary)


def assert_the_user_sees_one_run(run: dict, exp: ExpDir, summary: dict) -> None:
    """The launches' output and records, as the user reads them, across the three resumes."""
    first, last = run["outputs"][0], run["outputs"][-1]
    assert "gen-0 crashed" in first and "--resume" in first, first[-3000:]
    trained, marks = steps(exp), read_metrics(exp, "launcher", "resumed")
    assert len(marks) == 3, marks
    for mark in marks:    # each resume records the highest step trained before it
        assert mark["last_step"] == max(r["step"] for r in trained if r["time"] < mark["resumed_at"]), mark
    # The last launch: steps after its checkpoint may be redone, each version once, the numbering
    # continuing where the checkpoint left it; its progress is its own steps, not the run's again.
    resumed = [r for r in trained if r["time"] > marks[-1]["resumed_at"]]
    numbers = [r["step"] for r in resumed]
    assert numbers == list(range(numbers[0], summary["steps"] + 1)) and numbers[0] <= marks[-1]["last_step"] + 1
    assert f"step {numbers[0]}/{summary['steps']}" in last and "step 1/" not in last, last[-3000:]
    # Its first steps train groups an earlier launch generated, and their accuracy is found (not
    # `nan%`); throughput and RL time span this launch's steps, not the gaps before it.
    assert "nan" not in last, last[-3000:]
    assert summary["throughput"]["steps"] == len(numbers) and summary["throughput"]["trajectories_per_s"] > 0
    assert summary["rl_s"] <= resumed[-1]["time"] - resumed[0]["time"] + resumed[0]["step_s"] + 0.1
    registry = json.loads((exp.checkpoints / "controller" / "state.json").read_text())["registry"]
    assert [s["address"] for s in registry] == [json.loads(exp.service_file("gen-0").read_text())["url"]]


def test_a_non_finite_setting_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    code, named = nan_setting_refused(tmp_path, tiny_model_dir)
    assert code == 2 and named
