"""What each role's SLURM job asks for, from the experiment config and the allocation plan.

The plan fixes GPU counts; this turns them into submitit/sbatch requests: generation servers
one job each with `gen.tp_size` GPUs, the trainer one job with one task per GPU on its nodes,
CPU roles without GPUs. `exclusive` applies only to jobs that fill their nodes' GPUs, because an
exclusive single-GPU server would hold a whole node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.services.protocol import ExpDir

from ..config import ExperimentConfig, SlurmSection, save_resolved
from ..roles import Role
from .base import LaunchError

# The launcher's behaviour on SLURM is the `launcher.slurm` config section itself.
SlurmPolicy = SlurmSection


def policy_of(cfg: ExperimentConfig) -> SlurmPolicy:
    return cfg.launcher.slurm


@dataclass
class JobRequest:
    """One role's job: the role (what runs in each task) and what its job asks SLURM for."""
    role: Role
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    exclusive: bool = False
    distributed: bool = False       # export MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
    exclude: str = ""               # nodes not to run on (sbatch --exclude: `tandem scale --exclude`, lost nodes)

    @property
    def name(self) -> str:
        return self.role.name


def time_minutes(text: str | int) -> int:
    """SLURM's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(text).strip())
    if not m:
        raise LaunchError(f"launcher.slurm.time: cannot read {text!r} (use e.g. 24:00:00 or 2-00:00:00)")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:       # D-HH[:MM[:SS]]
        h, mi, s = a, b or 0, c or 0
        return days * 1440 + h * 60 + mi + (1 if s else 0)
    if c is not None:          # HH:MM:SS
        return a * 60 + b + (1 if c else 0)
    if b is not None:          # MM:SS
        return a + (1 if b else 0)
    return a                   # MM


def adopt_plan(cfg: ExperimentConfig, exp: ExpDir, plan=None):
    """The allocation plan (default `plan_for(cfg)`) the jobs are sized by, once checked.

    The plan decides the number of generation servers; roles read it from `<exp>/config.yaml`,
    so it is written there before the role list is built."""
    from ..plan import plan_for

    plan = plan or plan_for(cfg)
    if cfg.gen.num_servers != plan.num_servers:
        cfg.gen.num_servers = plan.num_servers
        save_resolved(cfg, exp.root)
    per_node = _trainer_ranks_per_node(plan)
    if len(set(per_node.values())) > 1:
        raise LaunchError(f"the plan puts trainer ranks unevenly on nodes ({per_node}); one SLURM job "
                          f"needs the same number of tasks on each node. Choose launcher.nodes / "
                          f"gen_train_ratio so training gets whole nodes or part of a single node")
    return plan


def _trainer_ranks_per_node(plan) -> dict[int, int]:
    per_node: dict[int, int] = {}
    for r in plan.trainer_ranks:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    return per_node


def job_requests(cfg: ExperimentConfig, roles: list[Role], plan) -> list[JobRequest]:
    """The jobs of an experiment's roles, sized by the (adopted) allocation plan: a generation
    server gets gen.tp_size GPUs, the trainer one task per GPU on its nodes, the rest one CPU task."""
    per_node = _trainer_ranks_per_node(plan)
    ranks_per_node = next(iter(per_node.values()))
    whole = cfg.launcher.slurm.exclusive
    out = []
    for role in roles:
        if role.kind == "gen":
            out.append(JobRequest(role, gpus_per_node=plan.gen_tp,
                                  exclusive=whole and plan.gen_tp == plan.gpus_per_node))
        elif role.kind == "trainer":
            out.append(JobRequest(role, nodes=len(per_node), tasks_per_node=ranks_per_node,
                                  gpus_per_node=ranks_per_node,
                                  exclusive=whole and ranks_per_node == plan.gpus_per_node, distributed=True))
        else:
            out.append(JobRequest(role))
    return out


def excluding(extra: str, *more: str) -> str:
    """Two `--exclude` hostlists as one (SLURM reads a comma-separated list of hostlists)."""
    return ",".join(x for x in (extra, *more) if x)
