"""Disk weights to N nodes: every node reading the shared filesystem vs the weight relay's chain
(`gen.weight_relay`, rollout/server/relay.py), in the miniature.

Each "node" is a relay process of its own, with its own directory (the relay's real code, real
TCP between processes). The shared filesystem is played by one more relay process serving the
version through a token bucket of FS_MB_S megabytes a second for all its readers together: a
filesystem's aggregate bandwidth, which is what N servers reading a version share (the premise;
nothing here measures a real filesystem). Per N:
- direct: every node fetches the version from the "filesystem" at once, as with plain disk sync;
- relay: the nodes are chained as the controller chains them (the first reads the filesystem,
  each next one streams from the one before while it receives), all asked at once.
Time = from the requests until the last node holds the whole version, median of REPEATS. What
this measures is the relay's own cost on top of one filesystem read: the chain's per-node
overhead (the simulator's `CHUNK_BYTES / node network` per node) on this machine's loopback and
CPUs. With more processes than CPUs the relays also share CPUs, which a cluster's nodes do not.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

KEY = "weight-relay-benchmark"
FS_MB_S = 200.0
VERSION_MB = 128
NODES = (1, 2, 4, 6)
REPEATS = 3
ROOT = Path(__file__).resolve().parents[1]


class _Bucket:
    """`rate` bytes a second shared by every connection of the process."""

    def __init__(self, rate: float):
        self.rate, self.next_free, self.lock = rate, time.monotonic(), threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            start = max(self.next_free, time.monotonic())
            self.next_free = start + n / self.rate
        time.sleep(max(0.0, self.next_free - time.monotonic()))


def serve(root: str, mb_s: float) -> None:
    """A relay process (`python -m benchmarks.weight_relay --serve ROOT MB_S`; 0 = unthrottled)."""
    from tandem.rollout.server.relay import WeightRelay

    relay = WeightRelay(root, KEY, host="127.0.0.1")
    if mb_s > 0:
        bucket, handle = _Bucket(mb_s * 1e6), relay._handle

        class Throttled:
            def __init__(self, sock):
                self.sock = sock

            def __getattr__(self, name):
                return getattr(self.sock, name)

            def sendall(self, data):
                bucket.take(len(data))
                self.sock.sendall(data)

            def sendfile(self, f, offset, count):
                bucket.take(count)
                return self.sock.sendfile(f, offset, count)
        relay._handle = lambda sock: handle(Throttled(sock))
    relay.start()
    print(relay.port, flush=True)
    threading.Event().wait()


def _start(root: Path, mb_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.weight_relay", "--serve", str(root), str(mb_s)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def _time_fetch(nodes: list[str], sources: list[str], version: int) -> float:
    from tandem.rollout.client.relay import relay_fetch

    async def main():
        await asyncio.gather(*(relay_fetch(n, KEY, version, s, 600, chain=f"c{version}")
                               for n, s in zip(nodes, sources, strict=True)))
    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0


def measure(work: Path, n: int, mb: int, repeats: int, fs_mb_s: float) -> dict:
    src_root = work / "fs"
    for v in range(2 * repeats):
        d = src_root / f"v{v}"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(src_root, 0o700)   # a relay's directory is its user's alone (it refuses others)
        (d / "model.safetensors").write_bytes(os.urandom(mb << 20))
    fs_proc, fs = _start(src_root, fs_mb_s)
    procs = [_start(work / f"node{i}", 0) for i in range(n)]
    nodes = [a for _, a in procs]
    try:
        out = {"direct": [], "relay": []}
        for r in range(repeats):
            out["direct"].append(_time_fetch(nodes, [fs] * n, 2 * r))
            out["relay"].append(_time_fetch(nodes, [fs, *nodes[:-1]], 2 * r + 1))
        return {k: statistics.median(v) for k, v in out.items()}
    finally:
        for p in [fs_proc, *(p for p, _ in procs)]:
            p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def main(quick: bool = False) -> dict:
    mb, nodes, repeats = (8, (1, 2), 1) if quick else (VERSION_MB, NODES, REPEATS)
    ideal = mb * (1 << 20) / (FS_MB_S * 1e6)
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-relay-") as tmp:
        for n in nodes:
            r = measure(Path(tmp) / f"n{n}", n, mb, repeats, FS_MB_S)
            results[n] = r
            rows.append([n, round(r["direct"], 3), round(r["relay"], 3), round(r["direct"] / r["relay"], 2),
                         round(r["relay"] / ideal, 3)])
    print_table(f"A {mb} MiB version to N nodes (relay processes), shared filesystem {FS_MB_S:.0f} MB/s in all "
                f"(median of {repeats}; one filesystem read takes {ideal:.2f} s)",
                ["nodes", "direct s", "relay s", "direct / relay", "relay / one read"], rows)
    last, first = max(nodes), min(nodes)
    per_node = (results[last]["relay"] - results[first]["relay"]) / max(1, last - first)
    headline = {"version_mb": mb, "fs_mb_s": FS_MB_S, "repeats": repeats, "one_read_s": round(ideal, 3),
                "nodes": list(nodes), "results": {str(k): v for k, v in results.items()},
                f"direct_s_{last}_nodes": round(results[last]["direct"], 3),
                f"relay_s_{last}_nodes": round(results[last]["relay"], 3),
                f"direct_over_relay_{last}_nodes": round(results[last]["direct"] / results[last]["relay"], 2),
                "relay_s_per_added_node": round(per_node, 3), "cpus": len(os.sched_getaffinity(0))}
    if not quick:
        write_results("weight_relay", headline)
    return headline


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], float(sys.argv[3]))
    else:
        cli(main)
