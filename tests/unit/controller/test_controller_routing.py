"""Routing in the server registry: least outstanding requests, proportional to capacity, sticky
keys with failover, and a clear error when no server is in rotation (pure, no server needed).
The health checks that feed the registry are in tests/integration/controller/test_controller_health.py.
"""
from __future__ import annotations

import pytest

from tandem.services.controller.registry import ServerRegistry

pytestmark = pytest.mark.timeout(60)


def test_routing_is_least_outstanding_and_sticky():
    reg = ServerRegistry(sticky_entries=3)
    a, _ = reg.register("http://a:1", capacity=2)
    b, _ = reg.register("http://b:1", capacity=4)
    counts = {"http://a:1": 0, "http://b:1": 0}
    for _ in range(6):
        counts[reg.pick().address] += 1
    assert counts == {"http://a:1": 2, "http://b:1": 4}          # proportional to capacity
    first = reg.pick("sample-1").address
    assert all(reg.pick("sample-1").address == first for _ in range(5))
    other = "http://b:1" if first == "http://a:1" else "http://a:1"
    assert reg.pick("sample-1", exclude=[first]).address == other   # failover moves the key
    reg.servers[other].take_out("failed an update")
    assert {reg.pick(f"k{i}").address for i in range(5)} == {first}
    a.healthy = b.healthy = False
    with pytest.raises(LookupError, match="no generation server is in rotation"):
        reg.pick()
    assert len(reg.sticky) <= 3
