"""Waiting on the processes of a multi-rank job started by a test: every rank's failure, not
only the first (a rank that dies leaves its peers to time out in a collective)."""
from __future__ import annotations

import os
import signal
import subprocess


def rank_errors(procs: list[subprocess.Popen], timeout_s: float = 240) -> list[str]:
    """The last 3,000 characters of stderr of each rank that failed or hung (then killed)."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode:
            errors.append(err[-3000:])
    return errors


def reap(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running of a job's ranks, and the helpers each rank started in its own
    process group (dist_checkpointing's writer processes)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
