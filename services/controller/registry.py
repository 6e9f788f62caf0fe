"""Generation servers known to the controller, their health, and where each request goes.

Routing is least-outstanding-requests, normalised by each server's declared capacity (AReaL
only round-robins, which piles long requests onto whichever server is slowest). The
controller cannot see requests end, so "outstanding" is the load the server itself reported
at the last health poll (running + waiting requests) plus the requests sent there since.
A request with a sticky key (one sample resubmitted after an interruption, a group's
samples) goes back to the server that served the key before, so its prefix cache helps.

A server is *servable* only when it is healthy and in rotation. It leaves the rotation when it
fails a weight update or is found holding other weights than the current version (it is then
kept paused, so it never serves old weights unnoticed) and comes back only after it has been
brought to the current version.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

KEY_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class GenServer:
    address: str
    api_key_ref: str = ""
    capacity: int = 64
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
        self.servers: dict[str, GenServer] = {}
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.sticky_entries = sticky_entries

    def register(self, address: str, api_key_ref: str = "", capacity: int = 64) -> tuple[GenServer, bool]:
        """Add (or update) a server; returns it and whether it is new."""
        if not isinstance(address, str) or not re.match(r"^https?://[^/\s]+", address):
            raise ValueError(f"register_server: address must be an http(s):// URL, got {address!r}")
        if api_key_ref and not KEY_REF.match(api_key_ref):
            raise ValueError(f"register_server: api_key_ref must be a file name under <exp>/keys/, "
                             f"got {api_key_ref!r}")
        if capacity < 1:
            raise ValueError(f"register_server: capacity must be >= 1, got {capacity}")
        address = address.rstrip("/")
        server = self.servers.get(address)
        if server is not None:
            server.api_key_ref, server.capacity = api_key_ref, capacity
            return server, False
        server = self.servers[address] = GenServer(address, api_key_ref, capacity)
        return server, True

    def pick(self, sticky_key: str = "", exclude: list[str] | None = None) -> GenServer:
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
    def _route(server: GenServer) -> GenServer:
        server.routed_since_poll += 1
        server.routed_total += 1
        return server

    def _none_servable(self) -> str:
        if not self.servers:
            return "no generation server is registered yet"
        why = "; ".join(f"{s.address}: {s.reason or 'unhealthy'}" for s in self.servers.values())
        return f"no generation server is in rotation ({why})"

    def servable(self) -> list[GenServer]:
        return [s for s in self.servers.values() if s.servable]

    def summary(self) -> list[dict]:
        return [{"address": s.address, "healthy": s.healthy, "in_rotation": s.in_rotation, "reason": s.reason,
                 "outstanding": s.outstanding, "capacity": s.capacity, "routed": s.routed_total,
                 "weight_version": s.weight_version} for s in self.servers.values()]

    # ---- persistence --------------------------------------------------------------------
    def state_dict(self) -> list[dict]:
        return [{k: v for k, v in asdict(s).items() if k not in ("load", "routed_since_poll", "failures")}
                for s in self.servers.values()]

    def load_state_dict(self, state: list[dict]) -> None:
        self.servers = {}
        for entry in state:
            server = GenServer(**entry)
            self.servers[server.address] = server
