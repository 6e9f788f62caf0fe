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

On SLURM the roles run in jobs on other nodes, where no process id of the launcher means
anything, and a job outlives a dead launcher until its time limit: hundreds of GPUs, for a day.
There the launcher holds a lease (`Heartbeat`: it renews `<exp>/services/launcher-heartbeat.json`
every tenth of `launcher.slurm.launcher_lease_s`), and each job's task (slurm_task.py) watches it
(`Lease`): unrenewed for the whole lease, by the task's own clock (the file's content changing is
what counts, not its time stamp from another node's clock, and a shared filesystem's caching is
far shorter than the lease), the task stops its role the same way and ends its job.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tandem.services.protocol import write_json_atomic
from tandem.services.protocol.runtime import STOP_GRACE_S

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


def stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat from its third field on (after the command name, which may hold spaces
    and parentheses): index i is field i + 3 of proc(5)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (exited, not yet reaped by its parent) is gone all the same
        return stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True   # no /proc here: kill's answer


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


def roles_of(exp_root: Path) -> list[str]:
    """`pid: command` of this machine's processes running a role of the experiment at `exp_root`
    (a launcher started them: its pid is in their environment; their command line holds
    `--exp ROOT`), but this one: what a new launch must wait for. A `tandem report --exp ROOT`
    run by hand is no role."""
    want = ["--exp", str(exp_root)]
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if not any(argv[i:i + 2] == want for i in range(len(argv) - 1)):
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                started_by_launcher = f"{PID_ENV}=".encode() in f.read()
        except OSError:
            continue
        if started_by_launcher and _alive(int(entry)):
            found.append(f"{entry}: {' '.join(argv)[:120]}")
    return found


# ---- SLURM: a lease on the shared filesystem -------------------------------------------------
HEARTBEAT_FILE = "launcher-heartbeat.json"   # in <exp>/services/


def heartbeat_interval(lease_s: float) -> float:
    return max(0.5, min(30.0, lease_s / 10))


class Heartbeat:
    """The launcher's side of the lease: renews `path` every `heartbeat_interval(lease_s)` from a
    thread, so it goes on while the launcher waits (a job in the queue, a teardown)."""

    def __init__(self, path: Path, lease_s: float):
        self.path, self.interval = path, heartbeat_interval(lease_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher-heartbeat", daemon=True)
        self.beats = 0

    def start(self) -> Heartbeat:
        self._beat()   # before any job can look
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        self.beats += 1
        try:
            write_json_atomic(self.path, {"beat": self.beats, "time": time.time(), "pid": os.getpid(),
                                          "host": os.uname().nodename})
        except OSError as e:   # a filesystem hiccup: the next beat tries again (the lease is long)
            log.warning("could not renew the launcher's lease at %s: %s", self.path, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()


class Lease:
    """A job's side: whether the launcher's heartbeat went unrenewed for `lease_s` seconds of this
    process's own clock (a missing file counts as unrenewed since the watch began)."""

    def __init__(self, path: Path, lease_s: float):
        self.path, self.lease_s = path, lease_s
        self._seen: bytes | None = None
        self._since = time.monotonic()

    def expired(self) -> bool:
        try:
            content = self.path.read_bytes()
        except OSError:
            content = None
        now = time.monotonic()
        if content is not None and content != self._seen:
            self._seen, self._since = content, now
        return now - self._since > self.lease_s
