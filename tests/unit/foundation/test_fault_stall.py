"""What a fault of benchmarks/faults.py is held to (`stall_s`, the test_faults run's stall check):
the longest wait between trained steps from the fault to the next one, with a launch-ending
fault counted from its resumed launch's first step (the resume's start-up is not a stall)."""
from __future__ import annotations

from benchmarks.faults import stall_s
from tandem.launcher.audit import Audit

STEPS = Audit(step_times=[0.0, 1.0, 2.0, 20.0, 21.0, 22.0, 90.0, 91.0, 92.0])


def test_a_fault_answers_for_the_wait_it_caused_and_not_for_later_ones():
    gen_kill = {"time": 2.5}
    assert stall_s(STEPS, gen_kill, until=50.0) == 18.0        # 2 -> 20: the restart it caused
    assert stall_s(STEPS, gen_kill, until=None) == 68.0        # unbounded: the later fault's too


def test_a_launch_ending_fault_counts_from_the_resumed_launchs_first_step():
    trainer_kill = {"time": 22.5, "resumed_at": 40.0}
    assert stall_s(STEPS, trainer_kill, until=None) == 1.0      # 22 -> 90 was the resume's start-up
    assert stall_s(Audit(step_times=[*STEPS.step_times, 160.0]), trainer_kill, until=None) == 68.0   # a stall after the resume counts


def test_no_step_in_the_window_is_no_wait():
    assert stall_s(STEPS, {"time": 95.0}, until=None) == 0.0
