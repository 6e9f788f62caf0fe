"""Rank offsets of a weight-broadcast group: the trainer is rank 0, then every TP rank of every
registered server in registry order (pure; the broadcast itself is in
tests/integration/controller/test_controller_weight_sync.py).
"""
from __future__ import annotations

import pytest

from tandem.services.controller.registry import RegisteredServer, broadcast_ranks

pytestmark = pytest.mark.timeout(60)


def test_broadcast_ranks_follow_the_registry_order_and_tp_sizes():
    servers_ = [RegisteredServer("http://a:1", tp_size=4), RegisteredServer("http://b:1", tp_size=1),
                RegisteredServer("http://c:1", tp_size=2)]
    offsets, world = broadcast_ranks(servers_)
    assert offsets == {"http://a:1": 1, "http://b:1": 5, "http://c:1": 6} and world == 8
    with pytest.raises(ValueError, match="tp_size unknown"):
        broadcast_ranks([RegisteredServer("http://d:1")])
