"""The launcher's few requests to the controller: a launch's start, a server joining, a server
retired, and whether the controller routes to a server. One signed request each, over the
run's keys (services/protocol), from the launcher's thread."""
from __future__ import annotations

import logging

from tandem.services.protocol import (
    ExpDir,
    RegisterServer,
    RetireServer,
    StatusRequest,
    SyncRequestClient,
    load_keys,
    read_service,
)

from .roles import GEN_ADMIN_KEY, GEN_API_KEY, Role

log = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 60.0   # the controller's wait for an update in progress, then the pause


def tell_controller(exp: ExpDir, body, timeout_s: float = 30.0):
    """The controller's reply to `body`; RemoteError for an error reply, TimeoutError for none."""
    controller = read_service(exp, "controller", timeout_s=10)
    client = SyncRequestClient(load_keys(exp.keys), controller["address"], timeout_s=timeout_s)
    try:
        return client.request(body)
    finally:
        client.close()


def server_address(exp: ExpDir, role: Role) -> str:
    """The URL generation server `role` announced in services/gen-<i>.json."""
    return read_service(exp, role.ready_file, timeout_s=5)["url"].rstrip("/")


def register_server(exp: ExpDir, role: Role) -> None:
    """A generation server joins the controller's rotation (as announced in services/gen-<i>.json),
    naming the key files it checks (the controller and workers read them from <exp>/keys/)."""
    info = read_service(exp, role.ready_file, timeout_s=10)
    tell_controller(exp, RegisterServer(address=info["url"], api_key_ref=GEN_API_KEY, admin_key_ref=GEN_ADMIN_KEY,
                                        tp_size=int(info.get("tp_size", 0)), relay=info.get("relay", ""),
                                        relay_node=info.get("relay_node", "")))


def retire_server(exp: ExpDir, address: str):
    """The controller lets go of `address` (services/controller/retirement.py); its Ok reply."""
    return tell_controller(exp, RetireServer(address=address, timeout_s=RETIRE_TIMEOUT_S), RETIRE_TIMEOUT_S + 30)


def servers(exp: ExpDir) -> list[dict] | None:
    """The controller's registry summary (address, in_rotation, reason, routed ...); None: no answer."""
    try:
        return tell_controller(exp, StatusRequest(), 10).state.get("servers", [])
    except Exception:
        return None


def registered(exp: ExpDir, address: str) -> bool | None:
    """Whether the controller routes to `address` (None: it did not say)."""
    known = servers(exp)
    return None if known is None else any(s.get("address", "").rstrip("/") == address for s in known)


def retire_quietly(exp: ExpDir, role: Role) -> None:
    """A server that started but failed to join may be registered: take it out (best effort)."""
    try:
        address = server_address(exp, role)
        if registered(exp, address):
            tell_controller(exp, RetireServer(address=address, timeout_s=10), 40)
    except Exception as e:
        log.warning("could not retire %s after its failed start: %s", role.name, e)
