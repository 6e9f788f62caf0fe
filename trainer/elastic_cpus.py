"""The trainer's side of the elastic split in the CPU miniature: follow the CPU set the launcher gives it.

With `launcher.elastic: true` the local launcher moves CPUs between generation and training
during a run (launcher/elastic.py): a retired generation server's CPUs go to the trainer, or the
trainer gives some up for a new server. It says so by writing `<exp>/services/trainer-cpus.json`
atomically: `{"seq": N, "cpus": [ids], "written": unix time}`. The trainer looks at it at every
step boundary and while it waits for data (one `stat` when nothing changed), and on a new `seq`:
  - re-pins EVERY thread of the process: Linux affinity is per thread, and
    `os.sched_setaffinity(0, ...)` moves only the calling one, so each thread in
    `/proc/self/task` is pinned by its id (torch's OpenMP pool, ZeroMQ's I/O thread, the intake
    thread); threads started later inherit the main thread's set;
  - sizes torch's intra-op pool to the set (`torch.set_num_threads`), then pins again, for the
    threads that call may have started;
  - logs a `trainer_cpus` metrics record (seq, CPUs, threads): the launcher waits for it before
    it starts a server on CPUs the trainer gave up, so the pools stay disjoint.
A file it cannot use (not JSON, wrong fields, CPUs this machine does not have), or a stale one
(a seq it has already applied, or written before this process started: an earlier launch's),
is ignored with one warning and a `trainer_cpus_ignored` record; it never stops the trainer.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tandem.services.protocol import ExpDir, MetricsWriter

log = logging.getLogger(__name__)

CPUS_FILE = "trainer-cpus"   # <exp>/services/trainer-cpus.json


def pin_all_threads(cpus: set[int], task_dir: Path = Path("/proc/self/task")) -> int:
    """Pin every thread of this process to `cpus`; returns how many were pinned. OSError when
    the set cannot be used at all (no such CPU, or none of them allowed)."""
    pinned = 0
    for entry in sorted(os.listdir(task_dir)):
        try:
            os.sched_setaffinity(int(entry), cpus)
        except ProcessLookupError:
            continue   # the thread ended meanwhile
        pinned += 1
    return pinned


class TrainerCpus:
    """Applies the launcher's CPU set for this trainer whenever it changes (see the module docstring)."""

    def __init__(self, exp: ExpDir, metrics: MetricsWriter | None = None, started: float | None = None):
        self.path = exp.service_file(CPUS_FILE)
        self.metrics = metrics
        self.started = time.time() if started is None else started
        self.seq = -1                       # the last seq applied
        self._seen: tuple[int, int] | None = None   # identity of the last file looked at

    def check(self) -> bool:
        """Apply a new CPU set if the launcher wrote one; True when it was applied. Never raises."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        identity = (st.st_ino, st.st_mtime_ns)
        if identity == self._seen:
            return False
        self._seen = identity
        try:
            return self._apply(self.path.read_text())
        except Exception as e:   # whatever the file holds, the trainer goes on
            self._ignore(f"{type(e).__name__}: {e}", None)
            return False

    def _apply(self, text: str) -> bool:
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            return self._ignore(f"not JSON ({e})", None)
        if not isinstance(spec, dict):
            return self._ignore(f"expected an object, got {type(spec).__name__}", None)
        seq, cpus, written = spec.get("seq"), spec.get("cpus"), spec.get("written")
        if not isinstance(seq, int) or isinstance(seq, bool):
            return self._ignore(f"seq must be an integer, got {seq!r}", None)
        if (not isinstance(cpus, list) or not cpus
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)):
            return self._ignore(f"cpus must be a non-empty list of CPU ids, got {cpus!r:.200}", seq)
        if seq <= self.seq:
            return self._ignore(f"stale: seq {seq} is not newer than the one applied ({self.seq})", seq)
        if not isinstance(written, int | float) or written < self.started:
            return self._ignore(f"stale: written at {written!r}, before this trainer started "
                                f"({self.started:.0f}; an earlier launch's)", seq)
        t0 = time.perf_counter()
        want = set(cpus)
        try:
            pinned = pin_all_threads(want)
        except OSError as e:
            return self._ignore(f"cannot pin to CPUs {sorted(want)}: {e.strerror or e}", seq)
        import torch

        torch.set_num_threads(len(want))
        pinned = max(pinned, pin_all_threads(want))   # threads the resize started
        self.seq = seq
        seconds = time.perf_counter() - t0
        log.info("CPU set %d: pinned %d threads to CPUs %s, %d torch threads (%.3fs)", seq, pinned,
                 sorted(want), torch.get_num_threads(), seconds)
        if self.metrics is not None:
            self.metrics.log(event="trainer_cpus", seq=seq, cpus=sorted(want), threads_pinned=pinned,
                             torch_threads=torch.get_num_threads(), seconds=seconds)
        return True

    def _ignore(self, why: str, seq: int | None) -> bool:
        log.warning("ignoring %s: %s", self.path, why)
        if self.metrics is not None:
            self.metrics.log(event="trainer_cpus_ignored", seq=seq, reason=why[:500])
        return False
