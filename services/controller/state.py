"""Durable controller state: an atomic snapshot plus a journal of every change since.

A snapshot alone would lose whatever happened since it was taken (a group reported accepted
a second before a crash would be counted again, or its slot leaked). So every ledger event is
appended to the journal (msgpack records, a few microseconds each: the journal sits on the
admission path), the events of a batch of requests with one `write` on an O_APPEND descriptor,
*before* any of their replies is sent: a process killed with SIGKILL loses nothing it acknowledged (the kernel
holds the bytes; only a power loss could, which fsyncing every event would cost too much to
prevent). A snapshot is written atomically (temp file, fsync, rename) on each version change,
on registry changes and periodically; it records the journal sequence number it covers, and the
journal is then truncated. Restoring = snapshot, then the journal entries with a higher number,
so a crash between the two steps never applies an event twice.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import msgpack

from tandem.services.protocol import write_json_atomic

log = logging.getLogger(__name__)


class StateStore:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.snapshot_path = self.dir / "state.json"
        self.journal_path = self.dir / "journal.msgpack"
        self.seq = 0
        self.since_snapshot = 0
        self._fd: int | None = None
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._unwritten: list[bytes] = []

    def load(self) -> tuple[dict | None, list[dict]]:
        """The last snapshot (None if there is none) and the events journalled after it."""
        snapshot = None
        covered = 0
        if self.snapshot_path.exists():
            try:
                snapshot = json.loads(self.snapshot_path.read_text())
                covered = int(snapshot.get("journal_seq", 0))
            except (ValueError, OSError) as e:
                raise RuntimeError(f"controller state {self.snapshot_path} is unreadable ({e}); move it "
                                   f"away to start from an empty state") from None
        events, last = [], covered
        if self.journal_path.exists():
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            unpacker.feed(self.journal_path.read_bytes())
            try:
                for record in unpacker:
                    seq, event = record
                    if seq > covered:
                        events.append(event)
                    last = max(last, seq)
            except (ValueError, TypeError, msgpack.UnpackException) as e:
                # Only a record cut by the crash can be broken; everything before it is intact.
                log.warning("journal %s: stopped at an unreadable record (%s)", self.journal_path, e)
        self.seq = last
        return snapshot, events

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, event: dict) -> None:
        """Record `event`; it reaches the file at the next `flush`, which the controller's
        request server calls before it sends any reply."""
        self.seq += 1
        self.since_snapshot += 1
        self._unwritten.append(self._pack([self.seq, event]))

    def flush(self) -> None:
        """Write the recorded events with one `write`."""
        if self._unwritten:
            os.write(self._fd, b"".join(self._unwritten))
            self._unwritten = []

    def snapshot(self, state: dict) -> float:
        """Write `state` atomically and empty the journal; returns the seconds it took."""
        t0 = time.perf_counter()
        write_json_atomic(self.snapshot_path, {**state, "journal_seq": self.seq, "saved_at": time.time()})
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
        self._unwritten = []    # the snapshot holds them
        self.since_snapshot = 0
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None
