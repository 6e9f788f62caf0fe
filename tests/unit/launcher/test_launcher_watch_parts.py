"""What the local launcher tells each role about itself, what a role makes of it, and the two
sides of the SLURM lease (launcher/launcher_watch.py; the watch with real processes is
tests/integration/launcher/test_launcher_watch.py, the lease on a real SLURM cluster
tests/integration/slurm/test_slurm_backend.py)."""
from __future__ import annotations

import os

import pytest

from tandem.launcher.launcher_watch import (
    GRACE_ENV,
    PID_ENV,
    SERVICES_STOP_AFTER_S,
    STOP_AFTER_ENV,
    launcher_env,
    watch_launcher_from_env,
)
from tandem.services.protocol import STOP_GRACE_S


@pytest.mark.parametrize("kind", ["controller", "reward", "gen"])
def test_services_wait_before_stopping_so_workers_and_trainer_can_still_report(kind):
    env = launcher_env(kind)
    assert env == {PID_ENV: str(os.getpid()), STOP_AFTER_ENV: f"{SERVICES_STOP_AFTER_S:g}",
                   GRACE_ENV: f"{STOP_GRACE_S:g}"}
    assert SERVICES_STOP_AFTER_S > 0


@pytest.mark.parametrize("kind", ["rollout", "trainer", "eval", "cpu"])
def test_the_others_stop_at_once_with_the_grace_they_are_given(kind):
    env = launcher_env(kind, 180.0)
    assert (env[STOP_AFTER_ENV], env[GRACE_ENV]) == ("0", "180")


def test_a_process_not_started_by_a_launcher_watches_nothing(monkeypatch):
    monkeypatch.delenv(PID_ENV, raising=False)
    assert watch_launcher_from_env() is None


def test_a_garbled_environment_is_named(monkeypatch):
    monkeypatch.setenv(PID_ENV, "12x")
    with pytest.raises(ValueError, match=PID_ENV):
        watch_launcher_from_env()


def test_a_lease_runs_out_only_after_the_heartbeat_has_not_changed_for_the_whole_lease(tmp_path, monkeypatch):
    """Lease (a SLURM job's side), on this process's clock: what counts is the content changing."""
    import tandem.launcher.launcher_watch as watch
    now = [1000.0]
    monkeypatch.setattr(watch.time, "monotonic", lambda: now[0])
    path = tmp_path / watch.HEARTBEAT_FILE
    lease = watch.Lease(path, 60.0)
    now[0] += 59
    assert not lease.expired()           # no file yet: counted from the watch's start
    now[0] += 2
    assert lease.expired()
    path.write_text('{"beat": 1}')
    assert not lease.expired()           # renewed
    now[0] += 59
    path.write_text('{"beat": 1}')       # rewritten, the same content: not a renewal
    now[0] += 2
    assert lease.expired()
    path.write_text('{"beat": 2}')
    assert not lease.expired()
    path.unlink()                        # gone (a cleaned directory): the last renewal still counts
    now[0] += 59
    assert not lease.expired()
    now[0] += 2
    assert lease.expired()


def test_the_heartbeat_renews_the_file_until_stopped(tmp_path):
    import json
    import time

    from tandem.launcher.launcher_watch import HEARTBEAT_FILE, Heartbeat, heartbeat_interval
    assert heartbeat_interval(600) == 30 and heartbeat_interval(1) == 0.5   # a tenth, within bounds
    path = tmp_path / HEARTBEAT_FILE
    beat = Heartbeat(path, 1.0)
    assert beat.interval == 0.5                         # the lease's
    beat.interval = 0.1                                 # (renewed faster here: the test waits for 3 beats)
    beat.start()
    assert json.loads(path.read_text())["beat"] == 1    # written before any job can look
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["beat"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    beat.stop()
    last = path.read_text()
    time.sleep(0.4)                                     # four intervals: no beat after stop()
    assert path.read_text() == last
