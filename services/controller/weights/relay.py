"""A disk version brought to every node through the servers' weight relays (`gen.weight_relay`).

The nodes form a chain: the first node's relay reads the trainer's directory from the shared
filesystem, every next one streams it from the previous node's relay while that one is still
receiving it (rollout/server/relay.py), so the filesystem is read once per version and the last
node has it about one chunk per node after the first. Every node is asked at once; each answers
when its copy is complete, and its servers then load that copy from disk as usual.

A node that fails breaks the chain after it: every node that failed is tried once more, each
reading the shared filesystem itself (through another of the node's relays where it has one), so
one dead relay costs the nodes after it a direct read, not the version. The servers of a node
that fails twice (its relay gone, its directory full) load the trainer's directory themselves,
as without a relay: the version still reaches them, and the sync records why
(`SyncResult.relay_fallback`).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

from tandem.rollout.client.relay import RelayError, relay_fetch

from ..registry import RegisteredServer
from .base import SyncRun

log = logging.getLogger(__name__)


def nodes_of(servers: list[RegisteredServer]) -> dict[str, list[RegisteredServer]]:
    """{node: its servers}, in registration order (the chain's order: stable between versions)."""
    out: dict[str, list[RegisteredServer]] = {}
    for s in servers:
        out.setdefault(s.relay_node, []).append(s)
    return out


async def relay_version(run: SyncRun, servers: list[RegisteredServer], source: str) -> dict[str, str]:
    """Bring the version at `source` (a directory on the shared filesystem) to the node of every
    server in `servers` (all with a relay); returns {server address: its node's copy}. A server
    missing from it is on a node that could not get one: it loads `source` itself."""
    t0 = time.perf_counter()
    nodes = nodes_of(servers)
    paths: dict[str, str] = {}
    errors: dict[str, str] = {}
    todo = list(nodes)
    for attempt in range(2):
        if not todo:
            break
        # First round: node i reads from node i - 1's relay, the first from the filesystem. The
        # retry: each node left reads the filesystem itself (the failed node may be any of them).
        relays = [nodes[n][min(attempt, len(nodes[n]) - 1)] for n in todo]
        sources = [source, *(r.relay for r in relays[:-1])] if attempt == 0 else [source] * len(relays)
        chain = secrets.token_hex(6)
        outcomes = await asyncio.gather(*(relay_fetch(r.relay, run.admin_for(r).admin_key or "", run.version, src,
                                                      run.timeout_s, chain)
                                          for r, src in zip(relays, sources, strict=True)), return_exceptions=True)
        failed = []
        for node, out in zip(todo, outcomes, strict=True):
            if isinstance(out, BaseException):
                errors[node] = str(out) if isinstance(out, RelayError) else f"{type(out).__name__}: {out}"
                failed.append(node)
            else:
                for s in nodes[node]:
                    paths[s.address] = out["path"]
        todo = failed
    run.result.phases["relay"] = run.result.phases.get("relay", 0.0) + time.perf_counter() - t0
    for node in todo:
        run.result.relay_fallback[node] = errors[node]
        log.warning("relay of v%d to node %s failed twice (%s): its servers load %s themselves", run.version, node,
                    errors[node], source)
    return paths
