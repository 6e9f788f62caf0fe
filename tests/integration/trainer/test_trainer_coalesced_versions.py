"""Coalesced versions, the trainer's side (trainer/announcements.py), as real processes: with
`controller.interruptible: false`, disk weights and `trainer.wait_for_ack: false`, the trainer
announces the next version while the controller still applies the previous one (a drain),
but never publishes a version that would prune, with `trainer.keep_weights`, one still waiting.

The controller is the stand-in of test_trainer_loop.py (fake_controller.py), which holds v1's
ack back as a drain would, and logs what it received and answered, in order.
"""
from __future__ import annotations

import sys

import pytest
from test_trainer_loop import FakeController, finish, groups, make_exp, start_trainer
from trainer_feed import send

pytestmark = pytest.mark.timeout(300)
SPECS = [("a", 0), ("b", 0), ("c", 0), ("d", 0), ("e", 1), ("f", 1)]


def events(ctl: FakeController) -> list[str]:
    f = ctl.state / "events"
    return f.read_text().splitlines() if f.exists() else []


def test_the_trainer_announces_ahead_of_a_draining_update_within_keep_weights(tmp_path, small_model_dir, traj):
    exp = make_exp(tmp_path, "coalesce", small_model_dir, **{
        "controller.interruptible": "false", "trainer.wait_for_ack": "false", "trainer.keep_weights": 2,
        "trainer.total_steps": 3, "trainer.checkpoint_every": 3})
    ctl = FakeController(exp, sys.executable, hold={1})
    try:
        proc = start_trainer(exp)
        send(exp, groups(traj, SPECS))
        # v2 is announced while v1 is still being applied (held): the trainer did not wait.
        ctl.wait_received(2, timeout_s=240)
        assert "answered 1" not in events(ctl)
        assert (exp.weights / "v1").is_dir()      # still there: publishing v2 kept the newest 2
        ctl.release(1)
        finish(proc, exp, timeout=240)
    finally:
        ctl.close()
    log = events(ctl)
    # v3 would have pruned v1 (keep_weights 2): it waited for v1's answer.
    assert log.index("received 2") < log.index("answered 1") < log.index("received 3"), log
    assert sorted(ctl.received) == [1, 2, 3] and {"answered 1", "answered 2", "answered 3"} <= set(log)
