"""The local backend's trainer: one role, one process per rank, as a SLURM job has one task per rank.

The backend-neutral role list (launcher/roles.py) holds one trainer role. On SLURM it becomes one
job with a task per rank, and `slurm_task.py` exports torch.distributed's variables to each; here
it becomes one child process per rank, each in its own process group like every other role, with
the same variables (torchrun's names): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and a
rendezvous file in the launch's private directory instead of SLURM's MASTER_ADDR/MASTER_PORT.

Why not `torchrun --standalone` as the trainer's command: its agent starts every worker in a
session of its own (torch.distributed.elastic's SubprocessHandler), so the supervisor could not
pin each rank to its CPU set before the rank starts threads, could not give each rank its console,
and a SIGKILL of the agent (what a stop ends with) would leave the ranks running. Started as
children of the supervisor, the ranks are stopped like every role — SIGTERM to each process group,
SIGKILL after the grace period (a rank blocked in a collective with a dead peer never reaches its
shutdown flag).

The run treats the ranks as one trainer, as it treats the SLURM job: ready when rank 0 announces
itself (only rank 0 writes services/trainer.json); finished when every rank has exited 0; failed
as soon as one rank fails, and the lifecycle then stops every role, the other ranks with them.
"""
from __future__ import annotations

from dataclasses import replace

from ..roles import Role
from .base import Ended

MASTER_ADDR = "127.0.0.1"
# The trainer ranks' rendezvous file (trainer/distributed.py reads it).
STORE_FILE_ENV = "TANDEM_STORE_FILE"


def rank_roles(role: Role, world: int) -> list[Role]:
    """The processes of trainer role `role` (`trainer-0`): rank 0 is the role itself (its name,
    its ready file); ranks 1.. are `trainer-1`, ... without one. The names are what the CPU
    placement (`CpuPlacement.cpus_for`) and SLURM's consoles (`slurm_task.console_name`) use."""
    base = role.name.rsplit("-", 1)[0]
    return [role] + [replace(role, name=f"{base}-{r}", index=r, ready_file=None) for r in range(1, world)]


def rank_env(rank: int, world: int, store_file: str) -> dict[str, str]:
    """torch.distributed's variables of one rank on this machine (none for a world of 1, which
    starts no process group: trainer/distributed.py): torchrun's names, and the
    rendezvous as a file in the launch's private directory (STORE_FILE_ENV) rather than a TCP
    store, which would listen unauthenticated on every interface for anyone to write into; the
    ranks' own connections stay on loopback."""
    if world == 1:
        return {}
    return {STORE_FILE_ENV: store_file, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": MASTER_ADDR,
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


class TrainerRanks:
    """The ranks of one trainer role and what the run has heard of their ends."""

    def __init__(self, role: Role, world: int):
        self.role = role
        self.ranks = rank_roles(role, world)
        self._running = {r.name for r in self.ranks}

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.ranks]

    def heard(self, end: Ended) -> Ended | None:
        """What the run hears of one rank's end: a failure at once (the trainer failed, whichever
        rank it was); a success only once every rank has exited 0 (the trainer finished)."""
        if not end.ok:
            return end
        self._running.discard(end.role.name)
        if self._running:
            return None
        return Ended(self.role, ok=True, why=end.why)
