"""Generation servers known to the controller, their health, and where each request goes.

Routing is least-outstanding-requests, normalised by each server's declared capacity (AReaL
only round-robins, which piles long requests onto whichever server is slowest). The
controller cannot see requests end, so "outstanding" is the load the server itself reported
at the last health poll (running + waiting requests) plus the requests sent there since.
A request with a sticky key (one sample resubmitted after an interruption, a group's
samples) goes back to the server that served the key before, so its prefix cache helps.

A server is *servable* only when it is healthy and in rotation. Healthy means it answers
`/model_info` (SGLang answers it from the HTTP process's own state: no generation, no scheduler
round trip, so it answers during a pause or a long weight update); its `weight_version` there is
the version the server holds. It leaves the rotation when it
fails a weight update or is found holding other weights than the current version (it is then
kept paused, so it never serves old weights unnoticed) and comes back only after it has been
brought to the current version.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from tandem.rollout.client import AdminClient, AdminError

log = logging.getLogger(__name__)

KEY_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class RegisteredServer:
    """The controller's record of one generation server it routes to: address, keys, capacity,
    health and rotation state, and the weight version it serves. (Not the server itself: that
    is `rollout.server.http_api.GenServer`, the embedded server's HTTP app.)"""
    address: str
    api_key_ref: str = ""
    capacity: int = 64
    # Key file of the server's admin key ("" = none: the API key is used on admin routes too).
    admin_key_ref: str = ""
    # GPUs (TP ranks) per server: each joins a weight broadcast; 0 = not known yet.
    tp_size: int = 0
    # Weight relay "host:port" and node (gen.weight_relay; services/controller/weights/relay.py).
    relay: str = ""
    relay_node: str = ""
    healthy: bool = True
    in_rotation: bool = True
    # Why the server is unhealthy or out of rotation ("" when servable).
    reason: str = ""
    # Consecutive failed health checks.
    failures: int = 0
    # Running + waiting requests at the last poll, and requests routed there since.
    load: int = 0
    routed_since_poll: int = 0
    routed_total: int = 0
    weight_version: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def outstanding(self) -> int:
        return self.load + self.routed_since_poll

    @property
    def servable(self) -> bool:
        return self.healthy and self.in_rotation

    def take_out(self, reason: str) -> None:
        self.in_rotation = False
        self.reason = reason

    def bring_back(self, version: int) -> None:
        self.in_rotation = True
        self.weight_version = version
        self.reason = ""


class ServerRegistry:
    def __init__(self, sticky_entries: int = 65536):
        self.servers: dict[str, RegisteredServer] = {}
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.sticky_entries = sticky_entries

    def register(self, address: str, api_key_ref: str = "", capacity: int = 64, admin_key_ref: str = "",
                 tp_size: int = 0, relay: str = "", relay_node: str = "") -> tuple[RegisteredServer, bool]:
        """Add (or update) a server; returns it and whether it is new. `tp_size` 0 = unknown
        (the health check asks the server)."""
        if not isinstance(address, str) or not re.match(r"^https?://[^/\s]+", address):
            raise ValueError(f"register_server: address must be an http(s):// URL, got {address!r}")
        for name, ref in (("api_key_ref", api_key_ref), ("admin_key_ref", admin_key_ref)):
            if ref and not KEY_REF.match(ref):
                raise ValueError(f"register_server: {name} must be a file name under <exp>/keys/, got {ref!r}")
        if capacity < 1:
            raise ValueError(f"register_server: capacity must be >= 1, got {capacity}")
        if tp_size < 0:
            raise ValueError(f"register_server: tp_size must be >= 1 (or 0 = ask the server), got {tp_size}")
        if relay and not re.match(r"^[^\s:/]+:\d+$", relay):
            raise ValueError(f"register_server: relay must be host:port, got {relay!r}")
        if relay and not relay_node:
            raise ValueError("register_server: a relay needs its relay_node (the node whose copy the server loads)")
        address = address.rstrip("/")
        server = self.servers.get(address)
        if server is None:
            server = self.servers[address] = RegisteredServer(address)
            new = True
        else:
            new = False
        server.api_key_ref, server.admin_key_ref, server.capacity = api_key_ref, admin_key_ref, capacity
        server.relay, server.relay_node = relay, relay_node
        if tp_size or new:
            server.tp_size = tp_size
        return server, new

    def pick(self, sticky_key: str = "", exclude: list[str] | None = None) -> RegisteredServer:
        """The server for one request; raises LookupError when none is servable."""
        excluded = set(exclude or ())
        if sticky_key:
            address = self.sticky.get(sticky_key)
            server = self.servers.get(address) if address else None
            if server is not None and server.servable and address not in excluded:
                self.sticky.move_to_end(sticky_key)
                return self._route(server)
        servable = [s for s in self.servers.values() if s.servable]
        if not servable:
            raise LookupError(self._none_servable())
        candidates = [s for s in servable if s.address not in excluded] or servable
        server = min(candidates, key=lambda s: (s.outstanding / s.capacity, s.outstanding))
        if sticky_key and self.sticky_entries:
            self.sticky[sticky_key] = server.address
            self.sticky.move_to_end(sticky_key)
            while len(self.sticky) > self.sticky_entries:
                self.sticky.popitem(last=False)
        return self._route(server)

    @staticmethod
    def _route(server: RegisteredServer) -> RegisteredServer:
        server.routed_since_poll += 1
        server.routed_total += 1
        return server

    def _none_servable(self) -> str:
        if not self.servers:
            return "no generation server is registered yet"
        why = "; ".join(f"{s.address}: {s.reason or 'unhealthy'}" for s in self.servers.values())
        return f"no generation server is in rotation ({why})"

    def servable(self) -> list[RegisteredServer]:
        return [s for s in self.servers.values() if s.servable]

    def summary(self) -> list[dict]:
        return [{"address": s.address, "healthy": s.healthy, "in_rotation": s.in_rotation, "reason": s.reason,
                 "outstanding": s.outstanding, "capacity": s.capacity, "routed": s.routed_total,
                 "weight_version": s.weight_version, "tp_size": s.tp_size,
                 **({"relay": s.relay, "relay_node": s.relay_node} if s.relay else {})}
                for s in self.servers.values()]

    # ---- persistence --------------------------------------------------------------------
    def forget_all(self) -> list[str]:
        """Drop every server (they belonged to an earlier launch); returns their addresses."""
        gone = list(self.servers)
        self.servers.clear()
        self.sticky.clear()
        return gone

    def forget(self, address: str) -> RegisteredServer | None:
        """Drop one server (retired from the run) and every sticky key that led to it."""
        server = self.servers.pop(address, None)
        if server is not None:
            for key in [k for k, a in self.sticky.items() if a == address]:
                del self.sticky[key]
        return server

    def state_dict(self) -> list[dict]:
        return [{k: v for k, v in asdict(s).items() if k not in ("load", "routed_since_poll", "failures")}
                for s in self.servers.values()]

    def load_state_dict(self, state: list[dict]) -> None:
        """Entries written before a field existed (e.g. `admin_key_ref`, `tp_size`) get its default."""
        self.servers = {}
        for entry in state:
            server = RegisteredServer(**entry)
            self.servers[server.address] = server


def broadcast_ranks(servers: list[RegisteredServer]) -> tuple[dict[str, int], int]:
    """Rank offsets of a weight-broadcast group and its world size.

    The trainer is rank 0. SGLang gives each TP rank of a server the group rank
    `rank_offset + tp_rank` (model_runner_components/weight_updater.py, init_weights_update_group),
    so a server's offset is 1 + the TP sizes of the servers before it, and the world is
    1 + the sum of all TP sizes.
    """
    offsets, rank = {}, 1
    for s in servers:
        if s.tp_size < 1:
            raise ValueError(f"{s.address}: tp_size unknown, so it has no rank in a broadcast group")
        offsets[s.address] = rank
        rank += s.tp_size
    return offsets, rank


async def learn_tp_size(server: RegisteredServer, admin: AdminClient, timeout_s: float) -> None:
    """A server registered without its TP size: `/server_info` reports its start-up `tp_size`
    (1 when it does not say; left unknown when it does not answer)."""
    try:
        info = await admin.server_info(timeout_s)
    except AdminError as e:
        log.warning("%s: /server_info failed, tp_size still unknown: %s", server.address, e.detail)
        return
    tp = info.get("tp_size")
    server.tp_size = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1
    if tp != server.tp_size:
        log.warning("%s: /server_info has no valid tp_size (%r); taking 1", server.address, tp)
