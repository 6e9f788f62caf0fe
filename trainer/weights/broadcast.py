"""Weights by broadcast: rank 0 of the trainer sends full tensors to the generation servers.

The trainer's rank 0 and every TP rank of every receiving server form a process group of their
own (not the trainer's world), with the rendezvous SGLang's `/init_weights_update_group` uses
(`services.protocol.weight_group.join_weight_group`, shared with the embedded server). Its size
is 1 + the receivers' TP ranks (SGLang joins each TP rank at `rank_offset + tp_rank`), which the
trainer knows from the config: `gen.num_servers * gen.tp_size`. Then every tensor is broadcast
from rank 0 in the order of `WeightsBroadcast.names`, one broadcast per tensor, as SGLang's
`/update_weights_from_distributed` receives them. `gloo` on CPU and `nccl` on GPUs go through
the same code, so the distributed path is tested here.
"""
from __future__ import annotations

import time

from tandem.services.protocol import WeightsBroadcast, collectives, free_port
from tandem.services.protocol.weight_group import join_weight_group, leave_weight_group
from tandem.trainer.backend import TrainBackend

from .base import Publication, WeightPublisher


class BroadcastPublisher(WeightPublisher):
    """`publish()` returns the message and a transfer that performs the rendezvous and the
    broadcasts (run it in a thread while the controller tells the servers to join)."""
    transfer_path = "network"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, receiver_ranks: int = 1,
                 timeout_s: float = 300.0, snapshot: bool = False):
        self.host, self.port = host, port
        # Copy the tensors first when training continues during the broadcast (overlap mode).
        self.snapshot = snapshot
        # Receiving ranks: the sum of the servers' TP sizes.
        self.receiver_ranks = receiver_ranks
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, tcfg, weights_root, receiver_ranks: int) -> BroadcastPublisher:
        return cls(tcfg.host, tcfg.broadcast_port, receiver_ranks, snapshot=not tcfg.wait_for_ack)

    def publish(self, backend: TrainBackend, version: int) -> Publication:
        t0 = time.perf_counter()
        params = [(n, t.clone() if self.snapshot else t) for n, t in backend.full_parameters()]
        port = self.port or free_port(self.host)
        world = 1 + self.receiver_ranks
        group_name = f"tandem-weights-v{version}"
        msg = WeightsBroadcast(version=version, group_name=group_name, master_address=self.host,
                               master_port=port, world_size=world, names=[n for n, _ in params],
                               dtypes=[str(t.dtype).removeprefix("torch.") for _, t in params],
                               shapes=[list(t.shape) for _, t in params])

        def send() -> dict:
            t0 = time.perf_counter()
            pg = join_weight_group(self.host, port, 0, world, group_name, timeout_s=self.timeout_s)
            t1 = time.perf_counter()
            try:
                for _, t in params:
                    collectives.broadcast(t, src=0, group=pg)
                t2 = time.perf_counter()
            finally:
                leave_weight_group(pg)
            n_bytes = sum(t.numel() * t.element_size() for _, t in params)
            return {"rendezvous_s": t1 - t0, "broadcast_s": t2 - t1, "bytes": n_bytes}

        return Publication(msg, {"gather_s": time.perf_counter() - t0}, send if backend.rank == 0 else None)
