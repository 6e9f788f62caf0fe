"""The trainer follows the CPU set the elastic split gives it (trainer/elastic_cpus.py): every
thread of the process re-pinned (Linux affinity is per thread), torch's pool resized, a metrics
record; a stale or garbled file is ignored with a warning and never stops the trainer.

This machine may have only two CPUs, so the "new" set is one CPU of those the process may use:
that is enough to see every thread move (their Cpus_allowed_list changes from both to one). The
test puts every thread and torch's thread count back as they were."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.services.protocol import MetricsWriter, read_metrics, write_json_atomic
from tandem.trainer.elastic_cpus import CPUS_FILE, TrainerCpus, pin_all_threads


def allowed_lists() -> dict[int, str]:
    """thread id -> its Cpus_allowed_list, for every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            text = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        out[int(tid)] = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                             if line.startswith("Cpus_allowed_list"))
    return out


@pytest.fixture
def restored():
    """Every thread and torch's pool as they were, whatever the test did."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield cpus
    pin_all_threads(cpus)
    torch.set_num_threads(threads)


@pytest.fixture
def sleepers():
    """Three more threads in this process: they must be re-pinned too."""
    stop = threading.Event()
    ts = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
    for t in ts:
        t.start()
    yield ts
    stop.set()
    for t in ts:
        t.join()


def write(exp, **spec) -> None:
    write_json_atomic(exp.service_file(CPUS_FILE), {"written": time.time(), **spec})
    time.sleep(0.01)   # a new mtime even on coarse clocks


def test_repins_every_thread_and_sizes_torch(exp, restored, sleepers):
    target = min(restored)
    metrics = MetricsWriter(exp, "trainer")
    follower = TrainerCpus(exp, metrics, started=time.time() - 1)
    assert follower.check() is False   # no file: nothing to do
    write(exp, seq=1, cpus=[target])
    assert follower.check() is True
    lists = allowed_lists()
    assert len(lists) >= 4 and set(lists.values()) == {str(target)}, lists
    assert {t.native_id for t in sleepers} <= set(lists)
    assert torch.get_num_threads() == 1
    assert follower.check() is False   # unchanged file: one stat, nothing applied
    metrics.close()
    (rec,) = read_metrics(exp, event="trainer_cpus")
    assert rec["seq"] == 1 and rec["cpus"] == [target] and rec["threads_pinned"] >= 4 and rec["torch_threads"] == 1


def test_stale_and_garbled_files_are_ignored_with_a_warning(exp, restored, caplog):
    metrics = MetricsWriter(exp, "trainer")
    follower = TrainerCpus(exp, metrics, started=time.time() - 1)
    path = exp.service_file(CPUS_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    before = allowed_lists()
    cases = [("{not json", "not JSON"),
             (json.dumps([1, 2]), "expected an object"),
             (json.dumps({"seq": "1", "cpus": [0], "written": time.time()}), "seq must be an integer"),
             (json.dumps({"seq": 1, "cpus": [], "written": time.time()}), "non-empty list"),
             (json.dumps({"seq": 1, "cpus": [0], "written": time.time() - 3600}), "before this trainer started"),
             (json.dumps({"seq": 1, "cpus": [100000], "written": time.time()}), "cannot pin")]
    with caplog.at_level(logging.WARNING, logger="tandem.trainer.elastic_cpus"):
        for text, why in cases:
            caplog.clear()
            path.write_text(text)
            os.utime(path, ns=(time.time_ns(), time.time_ns()))
            assert follower.check() is False
            assert why in caplog.text, (text, caplog.text)
        assert allowed_lists() == before            # nothing moved
        write(exp, seq=3, cpus=sorted(restored))     # a good file still applies after all that
        assert follower.check() is True
        caplog.clear()
        write(exp, seq=2, cpus=[min(restored)])      # older than the one applied
        assert follower.check() is False and "stale: seq 2" in caplog.text
    assert set(allowed_lists().values()) == set(before.values())
    metrics.close()
    ignored = read_metrics(exp, event="trainer_cpus_ignored")
    assert len(ignored) == len(cases) + 1 and all(r["reason"] for r in ignored)


def test_an_unreadable_file_never_raises(exp, restored, monkeypatch):
    follower = TrainerCpus(exp, None, started=time.time() - 1)
    write(exp, seq=1, cpus=[min(restored)])

    def broken(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr("tandem.trainer.elastic_cpus.pin_all_threads", broken)
    assert follower.check() is False and follower.seq == -1
