"""Discovery files and the metrics stream under concurrent writers and readers (real processes)."""
from __future__ import annotations

import json
import multiprocessing as mp

from tandem.services.protocol import ExpDir, MetricsWriter, read_metrics
from tandem.services.protocol.expdir import write_json_atomic


def _writer(path, n):
    for i in range(n):
        write_json_atomic(path, {"i": i, "pad": "x" * (1000 + 37 * (i % 50))})


def _reader(path, n, q):
    seen = bad = 0
    for _ in range(n):
        try:
            with open(path) as f:
                json.load(f)
            seen += 1
        except FileNotFoundError:
            pass
        except json.JSONDecodeError:
            bad += 1
    q.put((seen, bad))


def test_concurrent_writer_and_readers_never_see_a_partial_file(tmp_path):
    path = tmp_path / "services" / "x.json"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    w = ctx.Process(target=_writer, args=(path, 1500))
    readers = [ctx.Process(target=_reader, args=(path, 3000, q)) for _ in range(2)]
    w.start()
    for r in readers:
        r.start()
    w.join()
    for r in readers:
        r.join()
    results = [q.get() for _ in readers]
    assert all(bad == 0 for _, bad in results), results
    assert sum(seen for seen, _ in results) > 0
    assert not [p for p in path.parent.iterdir() if p.name != "x.json"]  # no temp files left


def _log_many(root, k):
    m = MetricsWriter(ExpDir(root), "w", rank=k)
    for i in range(400):
        m.log(step=i, blob="y" * (k * 300))
    m.close()


def test_metrics_lines_from_many_processes_stay_whole(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_log_many, args=(tmp_path, k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    recs = read_metrics(ExpDir(tmp_path))
    assert len(recs) == 1600
    assert sorted({r["rank"] for r in recs}) == [0, 1, 2, 3]
