"""Wire protocol cost: encode+decode of a 32K-token trajectory, and the round trip of a small
request over ZeroMQ with and without CURVE (server in its own process, as in production)."""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import multiprocessing as mp
import tempfile
import time

import numpy as np
import zmq

from benchmarks.common import cli, print_table, write_results
from tandem.services.protocol import AdmitReply, AdmitRequest, Trajectory, decode, encode, generate_keys
from tandem.services.protocol.keys import ensure_authenticator, make_client, make_server


def trajectory(n: int) -> Trajectory:
    rng = np.random.default_rng(0)
    return Trajectory(group_id="g-1", sample_idx=0, group_size=16,
                      prompt_ids=rng.integers(0, 150_000, 512, dtype=np.int32),
                      output_ids=rng.integers(0, 150_000, n, dtype=np.int32),
                      output_logprobs=rng.standard_normal(n).astype(np.float32),
                      output_versions=np.zeros(n, np.int32), admit_version=3, reward=5.0,
                      finish_reason="stop", task="math", timings={"gen_s": 12.5})


def codec_mb_s(n_tokens: int, seconds: float) -> tuple[float, int]:
    t = trajectory(n_tokens)
    size = len(encode(t))
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        decode(encode(t))
        reps += 1
    return reps * size / (time.perf_counter() - t0) / 1e6, size


def _serve(address_q, keys_dir, curve):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve:
        from tandem.services.protocol import load_keys
        keys = load_keys(keys_dir)
        ensure_authenticator(ctx, keys)
        make_server(sock, keys)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_q.put(f"tcp://127.0.0.1:{port}")
    reply = None
    while True:
        ident, frame = sock.recv_multipart()
        msg = decode(frame)
        if reply is None:
            reply = AdmitReply(tickets=[], version=0)
        sock.send_multipart([ident, encode(reply, msg.req_id)])


def rtt_us(curve: bool, n: int) -> tuple[float, float]:
    keys_dir = tempfile.mkdtemp() + "/keys"
    keys = generate_keys(keys_dir)
    q = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=_serve, args=(q, keys_dir, curve), daemon=True)
    proc.start()
    address = q.get(timeout=30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve:
        make_client(sock, keys)
    sock.connect(address)
    req = AdmitRequest(worker_id="w0", max_groups=4)
    lat = []
    for i in range(n + 200):
        t0 = time.perf_counter()
        sock.send(encode(req, i))
        decode(sock.recv())
        if i >= 200:  # warm-up: handshake and caches
            lat.append(time.perf_counter() - t0)
    proc.kill()
    sock.close(0)
    lat = np.array(lat) * 1e6
    return float(np.median(lat)), float(np.percentile(lat, 99))


def main(quick: bool = False) -> dict:
    seconds, n = (0.3, 500) if quick else (3.0, 10_000)
    mb_s, size = codec_mb_s(32768, seconds)
    plain50, plain99 = rtt_us(False, n)
    curve50, curve99 = rtt_us(True, n)
    print_table("services.protocol", ["measure", "value"], [
        ["32K-token trajectory frame (KB)", size / 1e3],
        ["encode+decode (MB/s)", mb_s],
        ["small request RTT, plain, p50 (us)", plain50],
        ["small request RTT, plain, p99 (us)", plain99],
        ["small request RTT, CURVE, p50 (us)", curve50],
        ["small request RTT, CURVE, p99 (us)", curve99],
        ["CURVE / plain p50", curve50 / plain50],
    ])
    headline = {"encode_decode_mb_s": round(mb_s, 1), "rtt_us_plain": round(plain50, 1),
                "rtt_us_curve": round(curve50, 1), "rtt_p99_us_plain": round(plain99, 1),
                "rtt_p99_us_curve": round(curve99, 1), "frame_bytes_32k": size}
    if not quick:
        write_results("protocol", headline)
    return headline


if __name__ == "__main__":
    cli(main)
