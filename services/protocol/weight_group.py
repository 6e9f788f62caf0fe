"""The weight-update process group: how the trainer and the generation servers meet for a broadcast.

This is the rendezvous contract of SGLang's `/init_weights_update_group`, shared by both ends:
the trainer's rank 0 (the sender) and every generation server (ranks 1..N, each at its
`rank_offset`). Both must wait on the same store keys, so both call this one function: a TCP
store at `master_address:master_port` hosted by rank 0, its keys prefixed by the group name,
and a process group of its own outside any default world (the trainer already has one; a
server has none). A plain `init_process_group(init_method=tcp://...)` on one side would wait on
unprefixed keys and never meet the other.

A submodule, not exported from `services.protocol`: it imports torch, which most roles never need.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def join_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str | None = None, timeout_s: float = 300.0):
    """Join (rank 0: host) the group; blocks until all `world_size` members have joined.

    Returns the process group; broadcast with `dist.broadcast(t, src=0, group=pg)`. `backend`
    defaults to nccl with CUDA and gloo without.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      timeout=timeout)
    # Ranks of this group are its own (0..world_size-1), so `src=0` names the sender in every process.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_weight_group(pg) -> None:
    """Destroy a group `join_weight_group` returned (each member does, after the last broadcast)."""
    dist.destroy_process_group(pg)
