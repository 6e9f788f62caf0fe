"""The trainer's own torch.distributed world, when it runs as several ranks.

The local launcher names a rendezvous file in its launch's private directory
(`TANDEM_STORE_FILE`, launcher/backends/local_ranks.py): a TCP store would listen unauthenticated
on every interface, where any user of the machine could write into it. On SLURM the ranks meet
through env:// (MASTER_ADDR/MASTER_PORT from slurm_task.py) as torchrun's do.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed() -> None:
    """Join the trainer's own world when launched with several ranks: through the rendezvous file
    the local launcher names (TANDEM_STORE_FILE: no listening store), else env:// (SLURM)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store_file = os.environ.get("TANDEM_STORE_FILE")
        rendezvous = ({"init_method": f"file://{store_file}", "rank": int(os.environ["RANK"]),
                       "world_size": int(os.environ["WORLD_SIZE"])} if store_file else {})
        # Rank 0 may wait a long time for trajectories while the others sit in a broadcast.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=6), **rendezvous)
