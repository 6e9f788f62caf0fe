"""The running controller's state (`StatusRequest`, signed with the run's keys), as `tandem status`
and the launcher ask for it: version, servers in rotation, counts."""
from __future__ import annotations

from tandem.services.protocol import ExpDir, StatusRequest, SyncRequestClient, load_keys, read_service


def controller_state(exp: ExpDir) -> dict:
    client = SyncRequestClient(load_keys(exp.keys), read_service(exp, "controller")["address"], timeout_s=10)
    try:
        return client.request(StatusRequest()).state
    finally:
        client.close()
