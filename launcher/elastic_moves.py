"""The elastic split's moves as CPU-set arithmetic, and the settings under which it can run.

In the CPU miniature the unit of a move is one generation server's CPU set (on a cluster it would
be a node's GPUs): the local placement (launcher/placement.py) gives each server and the trainer
disjoint CPU sets, as a cluster gives them disjoint GPUs, and a move hands one set across:
  generation -> training  the LAST server (gen-<k-1>) retires; the trainer gets exactly its CPUs;
  training -> generation  the trainer gives up the set of the server retired last, if it holds
                          it (a move and its reverse restore the same sets), else as many of its
                          own highest CPUs as the last server has; a new server gen-<k> starts
                          on them.
Servers stay gen-0..gen-<k-1>, so names, consoles and `services/gen-<i>.json` keep meaning one
slot each. A move that would leave generation without a server or the trainer without a CPU is
refused (`MoveRefused`). The functions are pure: `launcher/elastic.py` does the moves.

`elastic_problems` lists why `launcher.elastic: true` cannot run as configured (preflight.py
reports them with the other layout problems): only the local backend's embedded servers move
(CPU sets); a SLURM run would need an elastic trainer world (ranks joining and leaving
torch.distributed mid-run), which is not built, and neither is moving GPUs between SGLang servers
and trainer ranks on one machine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .placement import CpuPlacement, format_ranges


class MoveRefused(ValueError):
    """The move would leave a pool empty, or the placement is not one the moves handle."""


def _one_trainer(p: CpuPlacement) -> tuple[int, ...]:
    if len(p.trainer_ranks) != 1:
        raise MoveRefused(f"the trainer has {len(p.trainer_ranks)} ranks; moves handle one")
    return p.trainer_ranks[0]


def server_size(p: CpuPlacement) -> int:
    """CPUs a server added by a training -> generation move gets: as many as the last server has."""
    return len(p.servers[-1]) if p.servers else 0


def gen_to_train(p: CpuPlacement) -> CpuPlacement:
    """The last server's CPUs go to the trainer."""
    trainer = _one_trainer(p)
    if len(p.servers) < 2:
        raise MoveRefused(f"generation has {len(p.servers)} server(s) (CPUs {format_ranges(p.gen)}); "
                          f"moving one to training would leave none")
    freed = p.servers[-1]
    grown = tuple(sorted(set(trainer) | set(freed)))
    servers = p.servers[:-1]
    return replace(p, servers=servers, gen=tuple(sorted({c for s in servers for c in s})), train=grown,
                   trainer_ranks=(grown,), source="elastic")


def train_to_gen(p: CpuPlacement, retired: Sequence[tuple[int, ...]] = ()) -> CpuPlacement:
    """The trainer gives up CPUs to a new last server: the set of the server retired last
    (`retired`, a stack of the retired servers' sets) when the trainer still holds it, so a move
    and its reverse restore the same sets; else its own highest `server_size` CPUs."""
    trainer = _one_trainer(p)
    if retired and set(retired[-1]) <= set(trainer):
        given = tuple(sorted(retired[-1]))
    else:
        given = tuple(sorted(trainer)[-server_size(p):]) if server_size(p) else ()
    if not given or len(trainer) - len(given) < 1:
        raise MoveRefused(f"the trainer has {len(trainer)} CPU(s) ({format_ranges(trainer)}); giving a "
                          f"server {len(given) or server_size(p)} would leave it none")
    kept = tuple(c for c in trainer if c not in given)
    servers = (*p.servers, given)
    return replace(p, servers=servers, gen=tuple(sorted({c for s in servers for c in s})), train=kept,
                   trainer_ranks=(kept,), source="elastic")


def possible_moves(p: CpuPlacement, retired: Sequence[tuple[int, ...]] = ()) -> dict[str, CpuPlacement]:
    """{"to_train": placement, "to_gen": placement} for the moves that fit (none, one or both)."""
    out = {}
    for name, move in (("to_train", lambda: gen_to_train(p)), ("to_gen", lambda: train_to_gen(p, retired))):
        try:
            out[name] = move()
        except MoveRefused:
            pass
    return out


def elastic_problems(cfg, placement: CpuPlacement | None) -> list[tuple[str, str]]:
    """(key, message) for each reason `launcher.elastic: true` cannot run as configured."""
    if not getattr(cfg.launcher, "elastic", False):
        return []
    la = cfg.launcher
    if la.backend != "local":
        return [("launcher.elastic", f"true needs launcher.backend: local (got {la.backend!r}): on a cluster a move "
                                     f"needs an elastic trainer world (ranks joining and leaving torch.distributed "
                                     f"during the run) and re-used SLURM nodes, which are not built")]
    if cfg.gen.backend != "embedded":
        return [("launcher.elastic", f"true moves the CPU sets of embedded servers only; with gen.backend: "
                                     f"{cfg.gen.backend} it would move GPUs between servers and trainer ranks, "
                                     f"which is not built")]
    out = []
    if cfg.trainer.weight_sync != "disk":
        out.append(("trainer.weight_sync", f"{cfg.trainer.weight_sync} cannot hold with launcher.elastic: a server "
                                           f"added during the run is caught up by replaying the current version "
                                           f"from disk, and a broadcast cannot be replayed; use disk"))
    if la.cpus.trainer_ranks != 1:
        out.append(("launcher.cpus.trainer_ranks", f"{la.cpus.trainer_ranks} cannot hold with launcher.elastic: "
                                                   f"moving CPUs between trainer ranks is not built; use 1"))
    elif placement is None:
        out.append(("launcher.cpus.pin", "false leaves no CPU placement for launcher.elastic to move; set "
                                         "launcher.cpus.pin: true"))
    elif not possible_moves(placement):
        out.append(("launcher.elastic", f"no move fits these CPUs: {len(placement.servers)} generation server(s) "
                                        f"on CPUs {format_ranges(placement.gen)} and the trainer on "
                                        f"{format_ranges(placement.train)} ({len(placement.available)} CPUs: "
                                        f"{format_ranges(placement.available)}); a move needs 2 servers or a "
                                        f"training pool larger than one server's {server_size(placement)} CPU(s)"))
    return out
