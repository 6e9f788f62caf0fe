"""A role stops when the launcher that started it is gone.

The local launcher stops its roles itself: the rollout workers first, then the trainer (which
saves a checkpoint), then the services, each with SIGTERM and, after a grace, SIGKILL
(backends/local.py). It can do that only while it lives. Killed outright (SIGKILL, the OOM
killer, a supervisor's hard stop) it used to leave every role running in its own session: a
trainer training for nobody, servers holding their ports (and GPUs), and the next launch of the
experiment refused until someone found and killed them by hand.

So the local launcher names itself in each role's environment (`launcher_env`), and every
`tandem` process started with it watches that process (`watch_launcher_from_env`, called by
`tandem`'s main). When the launcher exits the role does what the launcher's teardown would have
done to it: it waits `stop_after` seconds (the services, so the rollout workers and the trainer
can still report to them, as in the launcher's own order), sends itself SIGTERM (its clean
shutdown: the trainer checkpoints, a worker returns its groups), and if still running after the
launcher's grace, SIGKILLs its process group. A pidfd (Linux 5.3+) wakes the watch the moment
the launcher exits; where there is none it looks twice a second.

On SLURM the cluster ends a job's processes with the job; those roles are not started this way.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

from services.protocol.runtime import STOP_GRACE_S

PID_ENV = "TANDEM_LAUNCHER_PID"
STOP_AFTER_ENV = "TANDEM_LAUNCHER_STOP_AFTER_S"
GRACE_ENV = "TANDEM_LAUNCHER_GRACE_S"
# Roles others report to, stopped last by the launcher: on its loss they wait this long first.
SERVICE_KINDS = ("controller", "reward", "gen")
SERVICES_STOP_AFTER_S = 3.0
POLL_S = 0.5

log = logging.getLogger(__name__)


def launcher_env(kind: str, grace_s: float = STOP_GRACE_S) -> dict[str, str]:
    """What the launcher adds to the environment of a role of `kind` it starts."""
    after = SERVICES_STOP_AFTER_S if kind in SERVICE_KINDS else 0.0
    return {PID_ENV: str(os.getpid()), STOP_AFTER_ENV: f"{after:g}", GRACE_ENV: f"{grace_s:g}"}


def watch_launcher_from_env() -> threading.Thread | None:
    """In a role started by the local launcher: stop when the launcher exits (module docstring).
    None when this process was not started by one."""
    text = os.environ.get(PID_ENV)
    if not text:
        return None
    try:
        pid = int(text)
        stop_after = float(os.environ.get(STOP_AFTER_ENV, "0"))
        grace = float(os.environ.get(GRACE_ENV, str(STOP_GRACE_S)))
    except ValueError as e:
        raise ValueError(f"${PID_ENV}, ${STOP_AFTER_ENV} or ${GRACE_ENV} is not a number: {e}") from None
    gone = _exit_of(pid)
    thread = threading.Thread(target=_watch, args=(pid, gone, stop_after, grace), name="launcher-watch",
                              daemon=True)
    thread.start()
    return thread


def _exit_of(pid: int) -> Callable[[], None]:
    """A call that returns once process `pid` has exited (at once if it already has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: None
    except (AttributeError, OSError):   # no pidfd here: look twice a second
        def poll() -> None:
            while _alive(pid):
                time.sleep(POLL_S)
        return poll

    def wait() -> None:
        select.select([fd], [], [])     # readable once the process has exited
    return wait


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (exited, not yet reaped by its parent) is gone all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _watch(pid: int, gone: Callable[[], None], stop_after: float, grace: float) -> None:
    gone()
    log.warning("the launcher (pid %d) is gone: stopping in %gs as it would have stopped this role "
                "(SIGTERM; SIGKILL after %gs more)", pid, stop_after, grace)
    time.sleep(stop_after)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    log.error("still running %gs after SIGTERM with the launcher gone: SIGKILL", grace)
    if os.getpgrp() == os.getpid():   # its own session, as the launcher starts it: its children too
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
