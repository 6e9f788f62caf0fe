"""What a holder of one role's key can do to a run (issue 68): a real controller process, and
clients holding one worker's key (services/protocol/keys.py), over real ZeroMQ sockets (the
trainer's side: tests/integration/trainer/test_trajectory_senders.py).

With every role sharing one key, a worker could act as any role: announce weights, register
servers, speak for another worker, train a group the controller never admitted, squat the next
group ids with bad samples until the trainer refused the real groups, or freeze the controller
with a 56 MiB heartbeat. Now each role has its own key, and the controller refuses, with an error reply, every op the sender's role does not send, and a
worker id that is not the sender's own; a frame over its size limit is cut off by the socket
while the controller goes on serving.
"""
from __future__ import annotations

import time

import pytest
from controller_helpers import write_config

from tandem.services.protocol import (
    AdmitRequest,
    GroupDone,
    Heartbeat,
    RegisterServer,
    RemoteError,
    StatusRequest,
    SyncRequestClient,
    WeightsOnDisk,
    generate_keys,
    load_keys,
    ticket_mac,
)


def test_a_workers_key_does_only_what_a_worker_does(exp, controller_proc):
    generate_keys(exp.keys, ["rollout-0", "rollout-1"])
    write_config(exp, groups_per_step=2, max_staleness=1)
    address = controller_proc().start()
    worker = SyncRequestClient(load_keys(exp.keys, "rollout-0"), address, timeout_s=10)
    admin = SyncRequestClient(load_keys(exp.keys), address, timeout_s=10)
    try:
        reply = worker.request(AdmitRequest("rollout-0-111", 2))
        assert len(reply.tickets) == 2
        # each ticket is signed for the worker that was granted it, and for no other
        t = reply.tickets[0]
        assert t.mac == ticket_mac(exp.keys, t.group_id, t.admit_version, "rollout-0")
        assert t.mac != ticket_mac(exp.keys, t.group_id, t.admit_version, "rollout-1")

        refused = {
            "another worker's id": AdmitRequest("rollout-1-222", 1),
            "another worker's group": GroupDone("rollout-1-222", t.group_id, "failed"),
            "another worker's heartbeat": Heartbeat("rollout-1-222", []),
            "a weight announcement": WeightsOnDisk(version=1, path=str(exp.weights / "v1")),
            "a server registration": RegisterServer(address="http://127.0.0.1:1", api_key_ref="gen-api-key"),
        }
        for what, body in refused.items():
            with pytest.raises(RemoteError, match=r"forbidden|is not rollout-0's"):
                worker.request(body)
            assert what   # (named for the failure message)
        state = admin.request(StatusRequest()).state
        assert state["version"] == 0 and state["admitted"] == 2 and state["servers"] == []
        assert worker.request(GroupDone("rollout-0-111", t.group_id, "failed")).detail   # its own: fine

        # A heartbeat of 5 MiB (listing made-up groups) is cut off by the socket: no reply, and
        # the controller goes on answering everyone at once.
        flood = SyncRequestClient(load_keys(exp.keys, "rollout-1"), address, timeout_s=3)
        with pytest.raises(TimeoutError):
            flood.request(Heartbeat("rollout-1-9", [f"{i}-{i}" * 20 for i in range(140_000)]))
        flood.close()
        t0 = time.monotonic()
        assert admin.request(StatusRequest()).state["admitted"] == 2
        assert time.monotonic() - t0 < 3   # well within the client's timeout: not frozen
    finally:
        worker.close()
        admin.close()
