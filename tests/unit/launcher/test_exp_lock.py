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


def test_a_lock_held_from_another_host_is_waited_for_then_refused(tmp_path, monkeypatch, capsys):
    """A launcher whose node died keeps its lock until the network filesystem's lease on it runs
    out: a launch from another host waits (a requeued job), and only then refuses."""
    import json

    import launcher.exp_lock as exp_lock
    root = tmp_path / "exp"
    hold_experiment(root)
    (root / exp_lock.LOCK_FILE).write_text(json.dumps({"pid": 7, "host": "dead-node", "started": 0}))
    monkeypatch.setattr(exp_lock, "OTHER_HOST_WAIT_S", 1.5)
    with pytest.raises(ExperimentInUse, match="pid 7 on dead-node"):
        hold_experiment(root)
    assert "locked from dead-node; waiting up to 2s" in capsys.readouterr().out
