"""Bad input never stops the controller: garbage, truncated, oversized and multi-part frames,
schema violations and impossible requests get error replies; a client with another
experiment's key gets nothing at all. After each, a valid request is still served."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import zmq
from controller_helpers import write_config

from tandem.services.protocol import (
    AdmitRequest,
    GroupDone,
    PickServer,
    RegisterServer,
    RemoteError,
    StatusRequest,
    SyncRequestClient,
    Ticket,
    TrainerResumed,
    WeightsBroadcast,
    WeightsOnDisk,
    decode,
    encode,
    generate_keys,
    load_keys,
)
from tandem.services.protocol.codec import MAX_FRAME_BYTES, PROTOCOL_VERSION
from tandem.services.protocol.keys import make_client

pytestmark = pytest.mark.timeout(120)


def raw_socket(keys, address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    make_client(sock, keys)
    sock.linger = 0
    sock.connect(address)
    return sock


def ask(sock, *frames, timeout_ms=5000):
    sock.send_multipart(list(frames))
    assert sock.poll(timeout_ms), "no reply"
    return decode(sock.recv())


def test_malformed_frames_get_error_replies_and_service_continues(exp, controller_proc):
    write_config(exp, groups_per_step=2, max_staleness=0)
    proc = controller_proc()
    address = proc.start()
    keys = load_keys(exp.keys)
    sock = raw_socket(keys, address)
    good = encode(AdmitRequest("w", 1), 5)
    cases = {
        b"\x00\xffgarbage\x13": "bad_frame",
        good[:len(good) // 2]: "bad_frame",                                          # truncated
        msgpack.packb([1, 2, 3]): "bad_envelope",
        msgpack.packb({"v": 99, "op": "admit", "id": 1, "body": {}}): "bad_version",
        msgpack.packb({"v": PROTOCOL_VERSION, "op": "admit", "id": 1,
                       "body": {"worker_id": "w", "max_groups": "many"}}): "bad_body",  # wrong type
        msgpack.packb({"v": PROTOCOL_VERSION, "op": "admit", "id": 1, "body": {"max_groups": 1}}): "bad_body",
        msgpack.packb({"v": PROTOCOL_VERSION, "op": "fly", "id": 1, "body": {}}): "unknown_op",
        encode(Ticket("0-1", 0), 1): "unsupported_op",                               # valid, not ours
    }
    for frame, code in cases.items():
        reply = ask(sock, frame)
        err = reply if not hasattr(reply, "body") else reply.body
        assert err.code == code, (frame[:40], err)
    reply = ask(sock, b"one", b"two")                                                 # multi-part
    assert reply.body.code == "bad_frame"
    # Oversized: libzmq drops the connection before anything is unpacked; no reply, no crash.
    sock.send(b"\x00" * (MAX_FRAME_BYTES + 1))
    assert not sock.poll(500)
    sock.close()
    client = SyncRequestClient(keys, address, timeout_s=5)
    try:
        assert len(client.request(AdmitRequest("w", 1)).tickets) == 1
        assert client.request(StatusRequest()).state["errors"] >= len(cases) + 1
    finally:
        client.close()
    assert proc.proc.poll() is None


IMPOSSIBLE = [
    (AdmitRequest("", 1), "worker_id must be a non-empty"),
    (AdmitRequest("w", 0), "max_groups must be >= 1"),
    (GroupDone("w", "0-999", "accepted"), "unknown group"),
    (WeightsOnDisk(version=1, path=""), "`path`"),
    (WeightsBroadcast(version=1, group_name="g", master_address="h", master_port=1,
                      world_size=2, names=["a"], dtypes=[], shapes=[[1]]), "equal length"),
    (RegisterServer(address="ftp://x"), "http"),
    (RegisterServer(address="http://x:1", api_key_ref="../../etc/passwd"), "file name"),
    (RegisterServer(address="http://x:1", admin_key_ref="../gen-admin-api-key"), "admin_key_ref must be a file"),
    (RegisterServer(address="http://x:1", tp_size=-2), "tp_size"),
    (TrainerResumed(version=-1, groups_held=0), ">= 0"),
]


def test_impossible_requests_are_rejected_by_name(exp, controller_proc):
    write_config(exp, groups_per_step=2, max_staleness=0)
    proc = controller_proc()
    client = SyncRequestClient(load_keys(exp.keys), proc.start(), timeout_s=5)
    try:
        for body, match in IMPOSSIBLE:
            with pytest.raises(RemoteError, match=match) as info:
                client.request(body)
            assert info.value.code == "rejected", body
        assert client.request(AdmitRequest("w", 1)).tickets
        # No server servable is a state to wait out, not a bad request: an answer with the reason.
        errors = client.request(StatusRequest()).state["errors"]
        choice = client.request(PickServer("w"))
        assert choice.address == "" and "no generation server" in choice.wait_reason
        assert client.request(StatusRequest()).state["errors"] == errors
    finally:
        client.close()


def test_versions_never_go_backwards_over_the_wire(exp, controller_proc):
    write_config(exp, groups_per_step=2, max_staleness=0)
    proc = controller_proc()
    client = SyncRequestClient(load_keys(exp.keys), proc.start(), timeout_s=5)
    try:
        assert client.request(WeightsOnDisk(version=2, path="/w/v2")).ok
        with pytest.raises(RemoteError, match="never go backwards"):
            client.request(WeightsOnDisk(version=1, path="/w/v1"))
        assert client.request(StatusRequest()).state["version"] == 2
        # A trainer resumed from the checkpoint of version 1 is the authority: it rebases.
        client.request(TrainerResumed(version=1, groups_held=2))
        state = client.request(StatusRequest()).state
        assert (state["version"], state["accepted"], state["capacity"]) == (1, 2, 2)
        assert client.request(WeightsOnDisk(version=2, path="/w/v2")).ok
    finally:
        client.close()


def test_a_client_with_another_experiments_key_is_refused(exp, controller_proc, tmp_path):
    """Even knowing the controller's public key, a client without the experiment's secret key
    fails the CURVE/ZAP handshake and gets no reply at all."""
    write_config(exp, groups_per_step=2, max_staleness=0)
    proc = controller_proc()
    address = proc.start()
    keys = load_keys(exp.keys)
    stranger = generate_keys(tmp_path / "other-keys")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    make_client(sock, dataclasses.replace(stranger, server_public=keys.server_public))
    sock.linger = 0
    sock.connect(address)
    try:
        sock.send(encode(AdmitRequest("intruder", 1), 1))
        assert not sock.poll(1500)
    finally:
        sock.close()
    insider = SyncRequestClient(keys, address, timeout_s=5)
    try:
        state = insider.request(StatusRequest()).state
        assert state["admitted"] == 0 and state["workers"] == 0
    finally:
        insider.close()
