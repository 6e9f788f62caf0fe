"""One launch at a time per experiment directory (launcher/exp_lock.py)."""
from __future__ import annotations

import os
import time

import pytest

from tandem.launcher.exp_lock import ExperimentInUse, hold_experiment


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

    import tandem.launcher.exp_lock as exp_lock
    root = tmp_path / "exp"
    hold_experiment(root)
    (root / exp_lock.LOCK_FILE).write_text(json.dumps({"pid": 7, "host": "dead-node", "started": 0}))
    monkeypatch.setattr(exp_lock, "OTHER_HOST_WAIT_S", 0.6)   # one retry (a second apart), then refused
    t0 = time.monotonic()
    with pytest.raises(ExperimentInUse, match="pid 7 on dead-node"):
        hold_experiment(root)
    assert time.monotonic() - t0 >= 0.6   # waited, not refused at once
    assert "locked from dead-node; waiting up to 1s" in capsys.readouterr().out


def test_the_last_launch_runs_only_if_its_pid_began_when_the_launch_did(tmp_path):
    """`tandem status`: a launcher's pid, once it has exited, may be another process's; its start
    time tells them apart."""
    import json

    import tandem.launcher.exp_lock as exp_lock
    root = tmp_path / "exp"
    assert exp_lock.last_launch(root) is None
    hold_experiment(root)
    held, running = exp_lock.last_launch(root)
    assert held["pid"] == os.getpid() and running is True   # this process holds it
    (root / exp_lock.LOCK_FILE).write_text(json.dumps({**held, "process_began": held["process_began"] - 3600}))
    assert exp_lock.last_launch(root)[1] is False            # the same pid, begun at another time: not it
    (root / exp_lock.LOCK_FILE).write_text(json.dumps({**held, "host": "elsewhere"}))
    assert exp_lock.last_launch(root)[1] is None             # that host's to say
