"""One launch at a time per experiment directory.

A second `tandem run ... --resume` on a directory whose first launch still runs (another tmux
pane, a terminal thought dead, a scheduled retry) used to go ahead: it rewrote the config,
replaced the generation servers' API keys under the running servers, and started a second
controller, trainer and set of workers writing the same checkpoints and records. So `tandem run`
holds an exclusive lock (`flock`) on `<exp>/launcher.lock` from before it changes anything
until it exits — the kernel releases it however the launcher ends, SIGKILL included — and a
second launch is refused before it touches the directory, naming the launch that holds it.
A lock held from another host (a launcher whose node died, its job requeued by SLURM) is
waited for up to `OTHER_HOST_WAIT_S`: a network filesystem frees a dead client's locks when its
lease runs out (NFSv4: 90 s by default). A filesystem without locks (some network mounts) gets
a warning and no lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import TextIO

from tandem.services.protocol.private import open_private

from .launcher_watch import stat_fields

LOCK_FILE = "launcher.lock"
OTHER_HOST_WAIT_S = 150.0
log = logging.getLogger(__name__)
_held: list[TextIO] = []   # the open lock files: released when this process exits


class ExperimentInUse(RuntimeError):
    pass


def hold_experiment(root: Path) -> None:
    """Lock `root` for this process's lifetime, or raise ExperimentInUse naming the holder."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    # Never through a symlink, never another user's file (services/protocol/private.py).
    f = os.fdopen(open_private(path, os.O_RDWR | os.O_CREAT | os.O_APPEND), "a+")
    deadline = None
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                f.close()
                log.warning("cannot lock %s (%s): a second launch of this experiment would not be refused",
                            path, e)
                return
        f.seek(0)
        held = _holder(f.read())
        if deadline is None and held.get("host") not in (None, os.uname().nodename):
            deadline = time.monotonic() + OTHER_HOST_WAIT_S
            print(f"{root} is locked from {held['host']}; waiting up to {OTHER_HOST_WAIT_S:.0f}s (a launch "
                  f"whose node died holds it until the filesystem's lease on it runs out) ...", flush=True)
        if deadline is None or time.monotonic() > deadline:
            f.close()
            raise ExperimentInUse(f"{root} is in use by another launch ({_describe(held)}); wait for it to "
                                  f"end, or stop it (Ctrl-C in its terminal, or SIGTERM to that process) and "
                                  f"run again")
        time.sleep(1.0)
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": time.time(),
                        "process_began": _began(os.getpid())}) + "\n")
    f.flush()
    _held.append(f)


def _holder(text: str) -> dict:
    try:
        held = json.loads(text)
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def _describe(held: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["started"]))
        return f"pid {held['pid']} on {held['host']}, since {since}"
    except (KeyError, TypeError, ValueError, OverflowError):
        return "its holder did not say who it is"


def last_launch(root: Path) -> tuple[dict, bool | None] | None:
    """The launch that last held `root` (pid, host, started) and whether it still runs: None
    when that is another host's to say; None for a directory no launch has held."""
    try:
        held = _holder((root / LOCK_FILE).read_text())
    except OSError:
        return None
    if not held.get("pid"):
        return None
    if held.get("host") != os.uname().nodename:
        return held, None
    began = _began(int(held["pid"]))
    # The same pid begun at another time is another process, the launcher's pid reused.
    return held, began is not None and abs(began - float(held.get("process_began") or 0)) < 1.0


def _began(pid: int) -> float | None:
    """When process `pid` began (seconds since the epoch), None if it is not running."""
    try:
        fields = stat_fields(pid)
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, IndexError, StopIteration, ValueError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
