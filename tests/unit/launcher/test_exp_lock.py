"""One launch at a time per experiment directory (launcher/exp_lock.py)."""
from __future__ import annotations

import os

import pytest

from launcher.exp_lock import ExperimentInUse, hold_experiment


def test_an_experiment_is_held_by_one_launch_and_a_second_is_told_who_holds_it(tmp_path):
    """launcher/exp_lock.py: flock is per open file, so a second hold in this same process meets
    the first exactly as a second launcher would (the real second launch: tests/integration/e2e/
    test_launcher_hazards.py)."""
    root = tmp_path / "exp"
    hold_experiment(root)
    with pytest.raises(ExperimentInUse, match=rf"in use by another launch \(pid {os.getpid()} on .*, since "):
        hold_experiment(root)
