"""PhaseTimer: the per-phase seconds a loop's metrics record carries (trainer steps)."""
from __future__ import annotations

import time

import pytest

from tandem.services.protocol import PhaseTimer


def test_phases_are_named_fields_that_add_up_within_the_total():
    timer = PhaseTimer()
    with timer.phase("wait"):
        time.sleep(0.01)
    with timer.phase("train_step"):
        time.sleep(0.02)
    with timer.phase("wait"):          # a phase entered twice accumulates
        time.sleep(0.01)
    fields = timer.fields(total="step_s")
    assert set(fields) == {"wait_s", "train_step_s", "step_s"}
    assert fields["wait_s"] >= 0.02 and fields["train_step_s"] >= 0.02
    assert fields["step_s"] >= fields["wait_s"] + fields["train_step_s"]


def test_a_phase_that_raises_is_still_timed():
    timer = PhaseTimer()
    with pytest.raises(ValueError), timer.phase("publish"):
        raise ValueError("x")
    assert "publish_s" in timer.fields()
