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
    assert set(previous) == {signal.SIGTERM, signal.SIGHUP}
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGHUP)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN   # a second one cannot cut the teardown short
    lifecycle._restore(previous)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_a_launcher_started_with_nohup_keeps_running_when_its_terminal_closes(dispositions):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    previous = lifecycle._sigterm_interrupts()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and set(previous) == {signal.SIGTERM}
    lifecycle._restore(previous)
