"""An append-only log of the trajectories accepted since the last checkpoint.

A checkpoint holds the replay buffer as it was when it was written; trajectories that arrive
afterwards live only in memory. If the trainer is killed (SIGKILL, OOM, node loss) they would be
gone, while the controller counts them as delivered, so the staleness budget would never admit
replacements and the resumed trainer could wait forever for groups that no longer exist. Each
accepted trajectory is therefore appended here (one unbuffered `write`, which survives the death
of the process); resume replays the log on top of the checkpoint's buffer. The buffer ignores
duplicates, so replaying a record that is also in the checkpoint is harmless.

Record format: 4-byte little-endian length + the trajectory's wire frame (services.protocol).
A record cut short by a crash mid-write is detected by its length and ignored.
"""
from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from tandem.services.protocol import ProtocolError, Trajectory, decode, encode

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")


def wal_path(root: Path, seq: int) -> Path:
    return Path(root) / f"trajectories-{seq:06d}.wal"


def wal_seqs(root: Path) -> list[int]:
    """Sequence numbers of the logs under `root`, oldest first."""
    return sorted(int(p.stem.split("-")[1]) for p in Path(root).glob("trajectories-*.wal"))


def delete_wals(root: Path, below: float) -> None:
    """Delete the logs older than `below` (their trajectories are in a checkpoint)."""
    for seq in wal_seqs(root):
        if seq < below:
            wal_path(root, seq).unlink(missing_ok=True)


class TrajectoryLog:
    def __init__(self, path: Path, truncate: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.path, flags, 0o600)

    def append(self, t: Trajectory) -> None:
        frame = encode(t)
        os.write(self._fd, _LEN.pack(len(frame)) + frame)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def replay(path: Path) -> Iterator[Trajectory]:
    """The trajectories in a log, in the order they were accepted; a torn tail is skipped."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    pos = 0
    while pos + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        if pos + _LEN.size + n > len(data):
            log.warning("%s: last record cut short (%d of %d bytes); ignored", path,
                        len(data) - pos - _LEN.size, n)
            return
        msg = decode(data[pos + _LEN.size: pos + _LEN.size + n])
        pos += _LEN.size + n
        if isinstance(msg, ProtocolError) or not isinstance(msg.body, Trajectory):
            log.warning("%s: undecodable record skipped: %s", path, msg)
            continue
        yield msg.body
