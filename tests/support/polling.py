"""Waiting in a test for something a real process does: `until(what, check)` returns the first
truthy value `check()` gives, or fails naming `what` once `timeout_s` has passed."""
from __future__ import annotations

import time


def until(what: str, check, timeout_s: float = 120.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
