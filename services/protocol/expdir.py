"""Where things live in an experiment directory; every role finds the others through it."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path


class ExpDir:
    """Paths of `<exp>/` as the architecture fixes them (shared filesystem on clusters)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()

    config = property(lambda self: self.root / "config.yaml")
    keys = property(lambda self: self.root / "keys")
    services = property(lambda self: self.root / "services")
    weights = property(lambda self: self.root / "weights")
    checkpoints = property(lambda self: self.root / "checkpoints")
    logs = property(lambda self: self.root / "logs")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    trajectories = property(lambda self: self.root / "trajectories")
    report = property(lambda self: self.root / "report")
    # Version 0 of a LoRA run's adapter (all zero), which generation servers start serving.
    initial_adapter = property(lambda self: self.root / "adapter-v0")

    def log_file(self, role: str, rank: int = 0) -> Path:
        return self.logs / f"{role}-{rank}.log"

    def service_file(self, role: str) -> Path:
        return self.services / f"{role}.json"


def numbered_dirs(root: str | os.PathLike, prefix: str) -> list[int]:
    """N of each directory `<root>/<prefix><N>`, ascending: the versions of `weights/v<N>` and
    `checkpoints/step-<N>` (none when `root` cannot be read)."""
    try:
        entries = [p for p in Path(root).iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    return sorted(int(p.name[len(prefix):]) for p in entries if p.name[len(prefix):].isdecimal() and p.is_dir())


def remove_leftovers(root: str | os.PathLike, *patterns: str) -> None:
    """Remove the half-written directories `<root>/<pattern>` an earlier trainer process left
    (killed mid-write, or stopped by a full disk): nothing will finish them, and they hold the
    space the next write needs. Only one trainer writes an experiment's `weights/` and
    `checkpoints/` at a time (the launch lock), so every match is one of those."""
    for pattern in patterns:
        for path in Path(root).glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON so a concurrent reader sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_service(exp: ExpDir, role: str, info: dict) -> None:
    """Announce a service (address, port, public key, pid ...) in `<exp>/services/<role>.json`."""
    write_json_atomic(exp.service_file(role), {**info, "role": role, "pid": os.getpid(),
                                               "published_at": time.time()})


def read_service(exp: ExpDir, role: str, timeout_s: float = 0.0, poll_s: float = 0.05) -> dict:
    """The service's announcement, waiting up to `timeout_s` for it to appear."""
    path = exp.service_file(role)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"service '{role}' not announced in {path} "
                                   f"after {timeout_s:.0f}s; is it running?") from None
        time.sleep(poll_s)


def previous_port(exp: ExpDir, role: str) -> int:
    """The port the service's previous process announced (0 if none): a restarted controller or
    reward service binds it again, so clients holding the old address reach the new process."""
    try:
        address = read_service(exp, role)["address"]
        return int(str(address).rsplit(":", 1)[1])
    except (TimeoutError, KeyError, ValueError, IndexError, OSError):
        return 0
