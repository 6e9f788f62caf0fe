"""What the local launcher tells each role about itself, and what a role makes of it
(launcher/launcher_watch.py; the watch itself, with real processes, is
tests/integration/launcher/test_launcher_watch.py)."""
from __future__ import annotations

import os

import pytest

from launcher.launcher_watch import (
    GRACE_ENV,
    PID_ENV,
    SERVICES_STOP_AFTER_S,
    STOP_AFTER_ENV,
    launcher_env,
    watch_launcher_from_env,
)
from services.protocol import STOP_GRACE_S


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
