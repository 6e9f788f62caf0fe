"""The unit tier's guard (tests/unit/conftest.py) trips: a unit test that starts a process or
opens a TCP, Unix or non-inproc zmq socket fails with a message saying to move it, while
threads, zmq inproc and asyncio's own socketpair keep working."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import pytest
import zmq

MESSAGE = r"unit tests start no processes/sockets: move .*test_unit_guard.py::.* to tests/integration"


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    lambda: subprocess.Popen(["true"]),
    lambda: os.system("true"),
    lambda: os.fork(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
], ids=["subprocess.run", "Popen", "os.system", "fork", "multiprocessing", "asyncio"])
def test_starting_a_process_is_refused(start):
    with pytest.raises(RuntimeError, match=MESSAGE):
        start()


@pytest.mark.parametrize("family, address", [(socket.AF_INET, ("127.0.0.1", 0)),
                                             (socket.AF_INET6, ("::1", 0))])
def test_binding_or_connecting_a_network_socket_is_refused(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        with pytest.raises(RuntimeError, match=MESSAGE):
            s.bind(address)
        with pytest.raises(RuntimeError, match=MESSAGE):
            s.connect(address)


def test_a_unix_socket_is_refused(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        with pytest.raises(RuntimeError, match=MESSAGE):
            s.bind(str(tmp_path / "sock"))


def test_zmq_allows_inproc_only():
    ctx = zmq.Context()
    try:
        server, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        server.bind("inproc://guard-test")
        client.connect("inproc://guard-test")
        client.send(b"ping")
        assert server.recv() == b"ping"
        for endpoint in ("tcp://127.0.0.1:*", "ipc:///tmp/guard-test"):
            with pytest.raises(RuntimeError, match=MESSAGE):
                server.bind(endpoint)
            with pytest.raises(RuntimeError, match=MESSAGE):
                client.connect(endpoint)
        server.close(0)
        client.close(0)
    finally:
        ctx.term()


def test_threads_and_an_asyncio_loop_still_work():
    seen = []
    t = threading.Thread(target=seen.append, args=(1,))
    t.start()
    t.join()

    async def answer():
        await asyncio.sleep(0)
        return 42
    assert asyncio.run(answer()) == 42 and seen == [1]
