"""A time limit on a block of Python, by an interval timer on the main thread, that nests.

Why our own: math-verify's timeouts use `signal.alarm` and raise ValueError off the main thread,
so they are always off here (reward/math_grader.py). Why it nests: a user's reward function
(reward/user_function.py) runs under its own limit and may call the built-in math grader,
which sets one too; a limit that simply cancelled the timer on exit would leave the rest of
the user's function with none. Here an inner limit never outlasts the outer one, and on exit
the outer timer is set again to what is left of it (at once, if it passed meanwhile).
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time


class TimeLimitExpired(BaseException):
    """Raised by the timer; BaseException so that a library's `except Exception` lets it by."""


def _expire(signum, frame):
    raise TimeLimitExpired()


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Interrupt the block after `seconds` with TimeLimitExpired (main thread only; elsewhere the
    block runs unbounded, and the caller's process must be killable, as the pool's workers are)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, _expire)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)   # what is left of an enclosing limit; 0: none
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-6))
