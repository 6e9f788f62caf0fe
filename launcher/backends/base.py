"""What the run lifecycle needs from a backend: start roles, hear when one ends, stop them.

`launcher/lifecycle.py` drives every run through this interface, so evaluation, the summary,
the report and the exit codes are the same whether roles are subprocesses on this machine
(`local.py`) or SLURM jobs (`slurm.py`). A backend owns only what differs: how a role is
started and sized, how its end is noticed and explained, whether it may be restarted.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ..roles import Role


class LaunchError(RuntimeError):
    """A role failed to start or died in a way the run cannot survive."""


class RoleFailed(LaunchError):
    """The run ends because a role's job (or process) ended: `end` says which and how, so the
    launcher can decide whether to continue the run by itself (launcher/continuation.py)."""

    def __init__(self, message: str, end: Ended):
        super().__init__(message)
        self.end = end


@dataclass
class Ended:
    """A role that stopped running since the last `Backend.ended()` call."""
    role: Role
    ok: bool                 # exited 0 / COMPLETED
    why: str = ""            # status, SLURM state, where its console is, the console's tail
    restarted: bool = False  # the backend already started it again (and waited until ready)
    # How it ended, as a word the continuation policy reads: SLURM's state (TIMEOUT, NODE_FAIL,
    # PREEMPTED, FAILED, CANCELLED, ...; TIMEOUT also for a role stopped by the time-limit
    # warning); "" where the backend cannot tell (the local one).
    cause: str = ""
    job_id: str = ""


class Announcement:
    """A role is ready once it writes `<exp>/services/<file>.json` after being started.

    The previous file is left in place rather than deleted: a restarted controller or reward
    service reads its old port from it and binds that port again, so clients holding the old
    address reconnect to the new process. Readiness is a new write: announcements are replaced
    atomically (a new file each time), so its inode or mtime differs from the one seen at start."""

    def __init__(self, path: Path):
        self.path = path
        self.before = _identity(path)

    def fresh(self) -> bool:
        now = _identity(self.path)
        return now is not None and now != self.before


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def announce_trainer_stop(seconds: float) -> None:
    """What a backend prints while a stopping trainer writes its last checkpoint."""
    print(f"stopping the trainer: it saves a checkpoint first (up to launcher.trainer_stop_s = {seconds:g} s; "
          f"Ctrl-C again to stop it now) ...", flush=True)


class Backend(ABC):
    """One run's roles on some machinery. Every method may raise LaunchError."""

    #: seconds between two looks at the roles while the run goes
    poll_s: float = 1.0
    #: how generation servers are addressed: the interface they bind, and a port for each
    gen_host: str = "127.0.0.1"
    #: why the run on this backend ended early (set by the lifecycle; None: it did not)
    failure: LaunchError | None = None

    @abstractmethod
    def pick_port(self) -> int:
        """A port for a generation server (0: the server picks one where it lands)."""

    def check_can_start(self) -> None:
        """Refuse (LaunchError) before anything starts, e.g. jobs of an earlier launch still run."""
        return None

    def prepare(self, roles: list[Role]) -> None:
        """Every role of the run, before the first wave starts: a backend may get ready for them
        (the local one starts its fork server, whose imports then overlap the first wave)."""
        return None

    @abstractmethod
    def start(self, roles: list[Role]) -> None:
        """Start the roles together and return once each with a ready_file has announced itself."""

    @abstractmethod
    def ended(self) -> list[Ended]:
        """Roles that stopped since the last call; restartable ones are restarted here."""

    @abstractmethod
    def run_to_end(self, role: Role) -> Ended:
        """Run a one-off role (an evaluation) to its end."""

    @abstractmethod
    def stop(self, roles: list[str] | None = None) -> None:
        """Stop the named roles (all when None); nothing of theirs stays running."""

    def running(self) -> None:
        """Every role is up (a backend may record it)."""
        return None

    def cancelled(self) -> bool:
        """The user asked from elsewhere (`tandem cancel`) that the run end."""
        return False

    def describe(self) -> str:
        """Where the roles run, for the line printed once they are all up."""
        return ""

    @abstractmethod
    def close(self, status: str) -> None:
        """After the run, whatever its end (finished, failed, interrupted, cancelled)."""

