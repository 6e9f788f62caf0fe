"""Controller admission throughput and latency: closed-loop clients, CURVE on, real process.

`tandem controller --exp DIR` runs in its own process with a staleness budget so large it never
binds (every request is granted one ticket, journalled before the reply, as in production).
N clients in this process share a few DEALER sockets (1.3-1.8x faster than one socket each, see
shared/BASELINES.md); each keeps exactly one admit request in flight (`measure`: one synchronous
loop drives them all, cheaper than the servers it measures). In a closed
loop p50 latency is about N / throughput, so the 512-client row measures throughput, and tail
latency is meaningful at 64 clients. A bare `RequestServer` answering the same reply with no
ledger, no journal (`echo` row) shows what the shared transport and codec alone allow at the
same moment on the same machine: the controller's own cost is the difference. A plain ROUTER
(`floor` row: CURVE, a synchronous poller draining every ready message, the reply's msgpack
made from the request id alone, no schema, replies sent in batches as the RequestServer sends
them) is the machine's own ceiling for this exchange, the method of shared/BASELINES.md: a
target in admissions/s means something only against it.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from benchmarks.common import cli, print_table, write_results
from tandem.services.protocol import (
    AdmitReply,
    AdmitRequest,
    ExpDir,
    RequestServer,
    Ticket,
    decode,
    encode,
    generate_keys,
    load_keys,
    read_service,
)
from tandem.services.protocol.keys import make_client
from tandem.services.protocol.transport import REPLY_BATCH, contexts

LEVELS = [(1, 1), (64, 4), (512, 4)]      # (clients, shared DEALER sockets)


def start_controller(root: Path) -> tuple[subprocess.Popen, str]:
    from tandem.launcher.config import load_config, save_resolved
    exp = ExpDir(root)
    generate_keys(exp.keys)
    cfg = load_config(None, ["experiment.name=bench", "experiment.model=/none", f"experiment.exp_dir={root}",
                             "trainer.groups_per_step=1000000000", "controller.max_staleness=0",
                             "controller.max_concurrent_groups=1000000000", "controller.snapshot_interval_s=3600",
                             "controller.metrics_interval_s=3600", "controller.health_interval_s=3600"])
    save_resolved(cfg, root)
    log = open(root / "controller.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "controller", "--exp", str(root)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            info = read_service(exp, "controller")
            if info.get("pid") == proc.pid:
                return proc, info["address"]
        except (TimeoutError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"controller did not start: {(root / 'controller.out').read_text()[-2000:]}")


def _echo_server(keys_dir: str, queue) -> None:
    """A RequestServer whose admit handler returns a constant one-ticket reply."""
    async def serve() -> None:
        reply = AdmitReply(tickets=[Ticket("0-0", 0)], version=0)
        server = RequestServer(load_keys(keys_dir), {"admit": lambda _req: reply})
        queue.put(server.address)
        await server.serve_forever()
    asyncio.run(serve())


def _floor_server(keys_dir: str, queue) -> None:
    """The least a server can do: read the request id, answer the same one-ticket reply."""
    import msgpack

    from tandem.services.protocol.keys import ensure_authenticator, make_server
    from tandem.services.protocol.transport import bind

    sync, _ = contexts()
    keys = load_keys(keys_dir)
    ensure_authenticator(sync, keys)
    sock = sync.socket(zmq.ROUTER)
    make_server(sock, keys)
    address = bind(sock, "127.0.0.1", 0)
    body = decode(encode(AdmitReply(tickets=[Ticket("0-0", 0)], version=0))).body
    reply = {"v": 1, "op": AdmitReply.OP, "id": 0, "body": {"tickets": [{"group_id": "0-0", "admit_version": 0}],
                                                            "version": 0, "retry_after_s": 0.0}}
    assert decode(msgpack.packb(reply)).body == body, "the floor's reply must decode as the controller's"
    queue.put(address)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    # As the RequestServer does: pyzmq's compiled send and recv with int flags, and the replies
    # sent together after each drain, at most REPLY_BATCH at a time.
    send, recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
    noblock, more = int(zmq.NOBLOCK), int(zmq.SNDMORE)

    def send_all(replies):
        for ident, payload in replies:
            send(sock, ident, more)
            send(sock, payload, 0)

    while True:
        poller.poll(1000)
        replies = []
        while True:
            try:
                ident = recv(sock, noblock)
            except zmq.Again:
                break
            reply["id"] = msgpack.unpackb(recv(sock, noblock))["id"]   # (the benchmark's requests are one frame)
            replies.append((ident, msgpack.packb(reply)))
            if len(replies) >= REPLY_BATCH:
                send_all(replies)
                replies = []
        send_all(replies)


def start_echo(keys_dir: Path, target=_echo_server) -> tuple[mp.Process, str]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(str(keys_dir), queue), daemon=True)
    proc.start()
    return proc, queue.get(timeout=60)


def measure(address: str, keys, clients: int, sockets: int, warmup_s: float, window_s: float) -> dict:
    """`clients` closed-loop clients over `sockets` DEALER sockets, each with one admit in flight:
    a reply is answered at once with that client's next request. The load generator is one
    synchronous loop over pre-encoded requests, so that it costs the server's machine less than
    the server does: clients written as asyncio coroutines with the product's codec capped every
    server, the plain ROUTER included, near 11K round trips/s on this 2-core machine."""
    ctx, _ = contexts()
    dealers = []
    for _ in range(sockets):
        sock = ctx.socket(zmq.DEALER)
        make_client(sock, keys)
        sock.linger = 0
        sock.connect(address)
        dealers.append(sock)
    requests = [encode(AdmitRequest(f"bench-{i}", 1), i) for i in range(clients)]
    sent_at = [0.0] * clients
    poller = zmq.Poller()
    for sock in dealers:
        poller.register(sock, zmq.POLLIN)
    latencies: list[float] = []
    granted = 0
    now = time.perf_counter
    t_measure = now() + warmup_s
    t_end = t_measure + window_s
    for i in range(clients):
        sent_at[i] = now()
        dealers[i % sockets].send(requests[i])
    first = None
    try:
        while now() < t_end:
            for sock, _ in poller.poll(100):
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = msgpack.unpackb(frame)
                    first = first or frame
                    i, t1 = reply["id"], now()
                    if sent_at[i] >= t_measure and t1 < t_end:
                        latencies.append(t1 - sent_at[i])
                        granted += len(reply["body"]["tickets"])
                    sent_at[i] = t1
                    sock.send(requests[i], zmq.NOBLOCK)
    finally:
        for sock in dealers:
            sock.close(0)
    if not latencies:
        raise RuntimeError(f"no admission completed within {window_s}s at {clients} clients")
    if not isinstance(decode(first).body, AdmitReply):
        raise RuntimeError(f"the server's reply is not an admit_reply: {decode(first)}")
    lat = np.array(latencies) * 1e3
    return {"clients": clients, "sockets": sockets, "admissions_per_s": len(lat) / window_s,
            "tickets_per_s": granted / window_s, "p50_ms": float(np.median(lat)),
            "p99_ms": float(np.percentile(lat, 99))}


def main(quick: bool = False) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warmup_s, window_s = (0.2, 0.5) if quick else (1.0, 3.0)
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-controller-"))
    proc, address = start_controller(root)
    keys = load_keys(ExpDir(root).keys)
    rows = []
    try:
        for clients, sockets in LEVELS:
            rows.append(measure(address, keys, clients, sockets, warmup_s, window_s))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    others = {}
    for name, target in (("echo", _echo_server), ("floor", _floor_server)):
        other_proc, other_address = start_echo(ExpDir(root).keys, target)
        try:
            others[name] = [measure(other_address, keys, c, s, warmup_s, window_s)
                            for c, s in LEVELS[1:]]
        finally:
            other_proc.kill()
    # In a closed loop a request waits for the others ahead of it: clients / throughput is the
    # queueing floor of its latency; p99 over it says how much worse than that the tail is.
    table = [[name, r["clients"], r["sockets"], r["admissions_per_s"], r["p50_ms"], r["p99_ms"],
              r["p99_ms"] / (1e3 * r["clients"] / r["admissions_per_s"])]
             for name, rs in (("controller", rows), *others.items()) for r in rs]
    print_table("controller admission round trips (CURVE on, closed loop)",
                ["server", "clients", "sockets", "admissions/s", "p50 ms", "p99 ms", "p99 / queueing floor"], table)
    headline = {}
    for r in rows:
        n = r["clients"]
        headline[f"admissions_per_s@{n}"] = round(r["admissions_per_s"], 1)
        headline[f"p50_ms@{n}"] = round(r["p50_ms"], 3)
        headline[f"p99_ms@{n}"] = round(r["p99_ms"], 3)
        headline[f"p99_over_floor@{n}"] = round(r["p99_ms"] / (1e3 * n / r["admissions_per_s"]), 2)
    for name, rs in others.items():
        for r in rs:
            headline[f"{name}_admissions_per_s@{r['clients']}"] = round(r["admissions_per_s"], 1)
    headline["controller_vs_floor@512"] = round(rows[-1]["admissions_per_s"]
                                                / others["floor"][-1]["admissions_per_s"], 3)
    if not quick:
        write_results("controller", headline)
    return headline


if __name__ == "__main__":
    cli(main)
