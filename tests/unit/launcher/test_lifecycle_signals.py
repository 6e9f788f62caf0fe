"""Which signals stop a run through its teardown (launcher/lifecycle.py), in this process."""
from __future__ import annotations

import signal

import pytest

from tandem.launcher import lifecycle


@pytest.fixture
def dispositions():
    saved = {sig: signal.getsignal(sig) for sig in lifecycle.STOPPING}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_sigterm_and_sighup_become_the_teardown_and_are_given_back(dispositions):
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    previous = lifecycle._sigterm_interrupts()
    assert set(previous) == {signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1}
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGHUP)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN   # a second one cannot cut the teardown short
    lifecycle._restore(previous)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_a_launcher_started_with_nohup_keeps_running_when_its_terminal_closes(dispositions):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    previous = lifecycle._sigterm_interrupts()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and set(previous) == {signal.SIGTERM, signal.SIGUSR1}
    lifecycle._restore(previous)


def test_sigusr1_stops_the_run_and_notes_that_the_launchers_job_nears_its_limit(dispositions, monkeypatch):
    """slurm/train.sbatch's warning (`--signal=B:USR1@300`): the same teardown as SIGTERM, and
    afterwards the launcher requeues its job (continuation.requeue_own_job); a SIGTERM does not."""
    from tandem.launcher import continuation

    monkeypatch.setattr(continuation, "_own_limit", type(continuation._own_limit)())
    previous = lifecycle._sigterm_interrupts()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)
    assert not continuation.own_limit_reached()
    lifecycle._restore(previous)
    previous = lifecycle._sigterm_interrupts()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGUSR1)
    assert continuation.own_limit_reached()
    lifecycle._restore(previous)
