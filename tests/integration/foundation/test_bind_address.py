"""What a service publishes as its address, locally and under SLURM (TANDEM_ADVERTISE_HOST)."""
from __future__ import annotations

import socket

import zmq

from tandem.services.protocol.transport import bind


def test_local_services_publish_what_they_bind(monkeypatch):
    monkeypatch.delenv("TANDEM_ADVERTISE_HOST", raising=False)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        assert bind(sock, "127.0.0.1", 0).startswith("tcp://127.0.0.1:")
    finally:
        sock.close(0)


def test_under_slurm_loopback_becomes_all_interfaces_and_the_node_name(monkeypatch):
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "localhost")  # a name that resolves here
    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        address = bind(server, "127.0.0.1", 0)
        assert address.startswith("tcp://localhost:")
        assert server.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://0.0.0.0:")
        client.connect(address)  # peers reach it by the published name
        client.send(b"ping")
        assert server.poll(5000) and server.recv_multipart()[1] == b"ping"
    finally:
        server.close(0)
        client.close(0)


def test_a_wildcard_host_publishes_the_machine_name(monkeypatch):
    monkeypatch.delenv("TANDEM_ADVERTISE_HOST", raising=False)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        assert bind(sock, "0.0.0.0", 0).startswith(f"tcp://{socket.gethostname()}:")
    finally:
        sock.close(0)
