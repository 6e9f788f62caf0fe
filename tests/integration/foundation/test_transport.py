"""Real ZeroMQ over TCP on 127.0.0.1 with CURVE, the server in its own process."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from tandem.services.protocol import (
    RemoteError,
    RequestClient,
    RequestServer,
    StatusReply,
    StatusRequest,
    SyncRequestClient,
    Trajectory,
    TrajectorySink,
    TrajectorySource,
    generate_keys,
    read_service,
)
from tandem.services.protocol.codec import MAX_FRAME_BYTES, encode
from tandem.services.protocol.transport import REPLY_BATCH

SERVER = Path(__file__).with_name("echo_server.py")


@pytest.fixture
def echo(exp):
    proc = subprocess.Popen([sys.executable, str(SERVER), str(exp.root)])
    try:
        info = read_service(exp, "echo", timeout_s=30)
        yield info["address"]
    finally:
        proc.kill()
        proc.wait()


def test_keyed_client_is_served_and_strangers_get_nothing(echo, keys, tmp_path):
    async def run():
        good = RequestClient(keys, echo, timeout_s=10)
        first = await good.request(StatusRequest())
        assert first.state["served"] == 1
        stranger = RequestClient(generate_keys(tmp_path / "other"), echo, timeout_s=1.0)
        with pytest.raises(TimeoutError):
            await stranger.request(StatusRequest())
        # A plain (non-CURVE) socket cannot even complete the handshake.
        plain = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        plain.linger = 0
        plain.connect(echo)
        await plain.send(encode(StatusRequest(), 7))
        assert await plain.poll(1000) == 0
        plain.close()
        # The server kept serving and counted only the authenticated requests.
        again = await good.request(StatusRequest())
        assert again.state["served"] == 2
        good.close()
        stranger.close()
    asyncio.run(run())


def test_garbage_gets_error_replies_and_service_survives(echo, keys):
    raw = SyncRequestClient(keys, echo, timeout_s=10)
    sock = raw.sock
    cases = [b"", b"\xc1\xc1", msgpack.packb([1, 2, 3]), encode(StatusRequest(), 5)[:-2],
             msgpack.packb({"v": 1, "op": "nope", "id": 9, "body": {}}),
             msgpack.packb({"v": 1, "op": "status", "id": 10, "body": {"x": 1}}),
             msgpack.packb({"v": 99, "op": "status", "id": 11, "body": {}})]
    codes = []
    for frame in cases:
        sock.send(frame)
        assert sock.poll(10000), f"no reply to {frame!r}"
        reply = msgpack.unpackb(sock.recv())
        assert reply["op"] == "error"
        codes.append(reply["body"]["code"])
    assert codes == ["bad_frame", "bad_frame", "bad_envelope", "bad_frame", "unknown_op",
                     "bad_body", "bad_version"]
    # A request of two frames (the server reads the `more` flag of each frame itself).
    sock.send_multipart([encode(StatusRequest(), 12), b"extra"])
    assert sock.poll(10000)
    reply = msgpack.unpackb(sock.recv())
    assert reply["op"] == "error" and reply["body"]["code"] == "bad_frame", reply
    # Oversized frames are cut off by the socket (MAXMSGSIZE); the server stays up.
    sock.send(b"\0" * (MAX_FRAME_BYTES + 1))
    assert raw.request(StatusRequest()).state["served"] == 1
    raw.close()


def test_remote_errors_surface_as_exceptions(echo, keys):
    client = SyncRequestClient(keys, echo, timeout_s=10)
    from tandem.services.protocol import AdmitRequest
    with pytest.raises(RemoteError) as e:
        client.request(AdmitRequest(worker_id="w"))
    assert e.value.code == "unsupported_op"
    client.close()


def test_trajectory_channel_delivers_in_order_with_backpressure(keys):
    sink = TrajectorySink(keys, hwm=4)

    def traj(i):
        return Trajectory(group_id=f"g{i}", sample_idx=0, group_size=1,
                          prompt_ids=np.arange(3, dtype=np.int32),
                          output_ids=np.full(32768, i, dtype=np.int32),
                          output_logprobs=np.zeros(32768, np.float32),
                          output_versions=np.zeros(32768, np.int32), admit_version=0,
                          reward=1.0, finish_reason="stop", task="math", timings={})

    async def produce():
        src = TrajectorySource(keys, sink.address, hwm=2)
        sent = 0
        with pytest.raises(TimeoutError):
            for i in range(1000):  # nobody reads: the queue fills and send times out
                await src.send(traj(i), timeout_s=0.5)
                sent += 1
        src.close(linger_ms=10_000)  # what was queued must still be delivered after close
        return sent

    sent = asyncio.run(produce())
    assert 0 < sent < 1000
    got = []
    while (t := sink.recv(timeout_s=10.0 if not got else 2.0)) is not None:
        got.append(t)
    assert [t.group_id for t in got] == [f"g{i}" for i in range(len(got))]
    assert got and int(got[0].output_ids[-1]) == 0 and got[-1].output_ids.dtype == np.int32
    sink.close()


def test_a_request_in_flight_when_its_service_restarts_is_sent_again_not_lost(exp, keys):
    """The service dies with the request unanswered and comes back on the same address (a new
    pid in its announcement): the client sends the request again at once and gets the answer in
    seconds, not after its timeout; nothing pending is cancelled (issue 19, defects 3 and 4)."""
    hanging = subprocess.Popen([sys.executable, str(SERVER), str(exp.root), "--hang"])
    replacement = None
    try:
        first = read_service(exp, "echo", timeout_s=30)

        async def run():
            nonlocal replacement
            client = RequestClient(keys, lambda: read_service(exp, "echo", timeout_s=5), timeout_s=60)
            waiting = asyncio.ensure_future(client.request(StatusRequest()))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            hanging.kill()
            hanging.wait()
            replacement = subprocess.Popen([sys.executable, str(SERVER), str(exp.root)])
            reply = await asyncio.wait_for(waiting, timeout=30)    # far less than the 60 s timeout
            assert reply.state["served"] == 1 and client.resends >= 1
            client.close()
        asyncio.run(run())
        assert read_service(exp, "echo")["address"] == first["address"]   # the same port again
    finally:
        for p in (hanging, replacement):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_the_blocking_client_also_sends_again_to_a_restarted_service(exp, keys):
    """The trainer's blocking client waiting for the controller's answer (a weight announcement)
    when the controller dies and comes back on its port: the request is sent again to the new
    process and answered in seconds, not after the timeout (found by the fault suite: the
    trainer sat out `ack_timeout_s`, 600 s, after a controller kill)."""
    import threading

    hanging = subprocess.Popen([sys.executable, str(SERVER), str(exp.root), "--hang"])
    replacement = None
    try:
        first = read_service(exp, "echo", timeout_s=30)
        client = SyncRequestClient(keys, first["address"], timeout_s=60,
                                   resolve=lambda: read_service(exp, "echo"))

        def restart():
            nonlocal replacement
            hanging.kill()
            hanging.wait()
            replacement = subprocess.Popen([sys.executable, str(SERVER), str(exp.root)])
        threading.Timer(1.0, restart).start()
        t0 = time.monotonic()
        reply = client.request(StatusRequest())
        assert reply.state["served"] == 1 and time.monotonic() - t0 < 30
        client.close()
    finally:
        for p in (hanging, replacement):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_burst_is_answered_in_batches_each_after_what_must_precede_its_replies(keys):
    """The server in this process (real CURVE sockets over TCP): 200 requests wait at its socket
    before it starts serving. No reply leaves before the `before_replies` call that follows its
    request (the controller writes its journal there: never a reply before its record): at each
    call the client has received at most the replies of the requests handled before the previous
    one. And the burst costs one call per REPLY_BATCH requests, not one each."""
    from tandem.services.protocol.keys import make_client

    handled, flushed, received, early = [], [], [0], []
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.linger = 0
    make_client(client, keys)

    def take_replies(wait_ms: int) -> None:
        while client.poll(wait_ms):
            msgpack.unpackb(client.recv())
            received[0] += 1
            wait_ms = 0

    def before_replies():
        take_replies(50)   # a reply sent before this call would be here by now
        if received[0] > (flushed[-1] if flushed else 0):
            early.append((received[0], list(flushed)))
        flushed.append(len(handled))

    def status(_body):
        handled.append(1)
        return StatusReply(state={})

    async def run():
        server = RequestServer(keys, {"status": status}, before_replies=before_replies)
        client.connect(server.address)
        for i in range(200):
            client.send(encode(StatusRequest(), i + 1))
        await asyncio.sleep(1.0)              # all 200 reach the server's socket; none is read
        serving = asyncio.ensure_future(server.serve_forever())
        deadline = time.monotonic() + 30
        while received[0] < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            take_replies(0)
        server.close()
        await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(run())
    client.close()
    assert received[0] == 200 and early == []
    assert flushed[0] == REPLY_BATCH and flushed[-1] == 200 and len(flushed) < 200, flushed
    assert all(0 < b - a <= REPLY_BATCH for a, b in zip([0, *flushed], flushed, strict=False)), flushed


def test_replies_whose_records_could_not_be_written_are_withheld_and_the_server_goes_on(keys):
    """`before_replies` fails (the controller's journal on a full disk): those requests are not
    acknowledged (their clients time out and ask again), and the next request is answered."""
    failing = {"now": True}

    def before_replies():
        if failing["now"]:
            failing["now"] = False
            raise OSError(28, "No space left on device")

    async def run():
        server = RequestServer(keys, {"status": lambda _b: StatusReply(state={})}, before_replies=before_replies)
        serving = asyncio.ensure_future(server.serve_forever())
        client = RequestClient(keys, server.address, timeout_s=1.0)
        with pytest.raises(TimeoutError):
            await client.request(StatusRequest())
        assert (await client.request(StatusRequest())).state == {}
        server.close()
        await asyncio.gather(serving, return_exceptions=True)
        client.close()

    asyncio.run(run())


def test_a_peer_that_never_completes_the_handshake_is_dropped(exp, monkeypatch):
    """On a cluster the services listen on TCP (transport.bind): a stranger's idle connection
    holds a descriptor only until the CURVE handshake's deadline (HANDSHAKE_S, shortened here),
    then the server closes it; members are served meanwhile."""
    import socket

    import tandem.services.protocol.transport as transport
    monkeypatch.setattr(transport, "HANDSHAKE_S", 1)
    keys = generate_keys(exp.keys)

    async def main():
        server = RequestServer(keys, {"status": lambda _b: StatusReply(state={"ok": 1})})
        serving = asyncio.ensure_future(server.serve_forever())
        host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
        idle = socket.create_connection((host, int(port)))
        idle.setblocking(False)
        try:
            client = RequestClient(keys, server.address, timeout_s=10)
            assert (await client.request(StatusRequest())).state == {"ok": 1}
            client.close()
            deadline = time.monotonic() + 10   # ZeroMQ's own default would wait 30 s
            while True:   # closed by the server: EOF (or a reset) on the stranger's side
                try:
                    if idle.recv(1024) == b"":
                        break
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    break
                assert time.monotonic() < deadline, "an idle peer was never dropped"
                await asyncio.sleep(0.1)
        finally:
            idle.close()
            server.close()
            serving.cancel()
    asyncio.run(main())
