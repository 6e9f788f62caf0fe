"""Weights by broadcast: the trainer (rank 0) sends every tensor over a torch.distributed group
the servers join for this version.

Per server, inside one weight-update session (SGLang 0.5.23 refuses distributed updates outside
one): `/begin_weight_update`, `/init_weights_update_group` (every TP rank of the server joins at
`rank_offset + tp_rank`; offsets from `registry.broadcast_ranks`), `/update_weights_from_distributed`
while the trainer sends, `/destroy_weights_update_group`, and `/end_weight_update` -- always
attempted on every server whose begin succeeded, even when a later step failed, so no server is
left with a session open (its next begin would be refused).

The group is a collective: if one receiver cannot join, nobody can complete it, so all fail.
A broadcast cannot be replayed for a server that missed it; it rejoins at the next update.
"""
from __future__ import annotations

import asyncio

from tandem.services.protocol import WeightsBroadcast

from ..registry import RegisteredServer, broadcast_ranks, learn_tp_size
from .base import SyncRun, WeightApplier


class BroadcastApplier(WeightApplier):
    message = WeightsBroadcast

    def check(self, msg: WeightsBroadcast) -> None:
        if msg.version < 0:
            raise ValueError(f"weights_broadcast: version must be >= 0, got {msg.version}")
        missing = [k for k in ("group_name", "master_address") if not getattr(msg, k)]
        if missing or msg.master_port <= 0 or msg.world_size < 2:
            raise ValueError(f"weights_broadcast: needs group_name, master_address, master_port > 0 and "
                             f"world_size >= 2 (missing/invalid: {missing or 'master_port/world_size'})")
        n = len(msg.names)
        if n == 0 or len(msg.dtypes) != n or len(msg.shapes) != n:
            raise ValueError(f"weights_broadcast: names, dtypes and shapes must be non-empty lists of equal "
                             f"length (got {n}, {len(msg.dtypes)}, {len(msg.shapes)})")

    async def receivers(self, run: SyncRun, servers: list[RegisteredServer], msg: WeightsBroadcast) -> list[RegisteredServer]:
        """Servers in registration order while their TP ranks fit in the group; all of its
        world_size - 1 receiving ranks must be filled, or nobody takes part. A TP size not
        known yet (registered without one, not health-checked yet) is asked first."""
        unknown = [s for s in servers if s.tp_size < 1]
        await asyncio.gather(*(learn_tp_size(s, run.admin_for(s), self.cfg.http_timeout_s) for s in unknown))
        want = msg.world_size - 1
        chosen, ranks = [], 0
        for s in servers:
            if s.tp_size < 1:
                run.fail(s, f"its tp_size is unknown, so it has no rank in the broadcast of v{msg.version}")
            elif ranks + s.tp_size <= want:
                chosen.append(s)
                ranks += s.tp_size
            else:
                run.fail(s, f"not in the broadcast group of v{msg.version} (world_size {msg.world_size}: "
                            f"{want} receiving ranks); will rejoin at the next update")
        if ranks < want:
            for s in chosen:
                run.fail(s, f"the broadcast of v{msg.version} needs {want} receiving ranks, the healthy "
                            f"servers have {ranks} (sum of their tp_size)")
            return []
        return chosen

    async def update(self, run: SyncRun, servers: list[RegisteredServer], msg: WeightsBroadcast) -> list[RegisteredServer]:
        t = run.timeout_s
        opened = await run.phase("begin", servers, lambda a: a.begin_weight_update(timeout_s=t))
        live: list[RegisteredServer] = []
        if len(opened) == len(servers):
            offset = broadcast_ranks(opened)[0]
            joined = await run.phase("init_group", opened, lambda a: a.init_weights_update_group(
                msg.master_address, msg.master_port, offset[a.url], msg.world_size, msg.group_name,
                self.cfg.broadcast_backend, timeout_s=t))
            if len(joined) == len(opened):
                live = await run.phase("update", joined, lambda a: a.update_weights_from_distributed(
                    msg.names, msg.dtypes, msg.shapes, msg.group_name, msg.version,
                    flush_cache=run.flush_cache, timeout_s=t))
                await run.phase("destroy_group", joined,
                                lambda a: a.destroy_weights_update_group(msg.group_name, timeout_s=t), fatal=False)
            else:
                for s in joined:
                    run.fail(s, f"another receiver could not join the broadcast group of v{msg.version}")
        else:
            for s in opened:
                run.fail(s, f"another receiver could not open a weight-update session for v{msg.version}")
        # Close every session that was opened, whatever happened in between.
        closed = await run.phase("end", opened, lambda a: a.end_weight_update(timeout_s=t))
        done = {s.address for s in closed}
        return [s for s in live if s.address in done]
