"""The interval-timer limit nests (reward/time_limit.py): a user's reward function runs under one
and may call the math grader, which sets its own. The inner limit must not cancel the outer one,
nor outlast it. (pytest-timeout's own SIGALRM timer is a third, outermost one here: it must
survive too.)"""
from __future__ import annotations

import signal
import time

import pytest

from tandem.reward.time_limit import TimeLimitExpired, time_limit


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_outer_limit_still_holds_after_an_inner_one_ends():
    t0 = time.monotonic()
    with pytest.raises(TimeLimitExpired):
        with time_limit(0.3):
            with time_limit(5.0):
                _spin(0.05)
            _spin(5.0)              # an inner limit that cancelled the timer would let this run
    assert 0.25 < time.monotonic() - t0 < 1.5


def test_an_inner_limit_fires_first_and_the_outer_goes_on():
    t0 = time.monotonic()
    with time_limit(2.0):
        with pytest.raises(TimeLimitExpired):
            with time_limit(0.1):
                _spin(5.0)
        assert time.monotonic() - t0 < 1.0
    assert time.monotonic() - t0 < 1.0


def test_an_inner_limit_never_outlasts_the_outer_one():
    t0 = time.monotonic()
    with pytest.raises(TimeLimitExpired):
        with time_limit(0.2):
            with time_limit(10.0):
                _spin(5.0)
    assert time.monotonic() - t0 < 1.0


def test_an_enclosing_timer_and_handler_are_given_back():
    before = signal.getsignal(signal.SIGALRM)
    outer_before, _ = signal.getitimer(signal.ITIMER_REAL)
    with time_limit(0.5):
        _spin(0.01)
    outer_after, _ = signal.getitimer(signal.ITIMER_REAL)
    assert signal.getsignal(signal.SIGALRM) is before
    if outer_before:    # pytest-timeout's timer: still running, a little less left
        assert 0 < outer_after <= outer_before
    else:
        assert outer_after == 0
