"""What each role's SLURM job asks for, from the experiment config and the allocation plan.

The plan fixes GPU counts; this turns them into submitit/sbatch requests: generation servers
one job each with `gen.tp_size` GPUs, the trainer one job with one task per GPU on its nodes,
CPU roles without GPUs. `exclusive` applies only to jobs that fill their nodes' GPUs, because an
exclusive single-GPU server would hold a whole node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from services.protocol import ExpDir

from .config import ExperimentConfig, SlurmSection, save_resolved
from .local import LaunchError, RoleSpec, tandem_argv

# The launcher's behaviour on SLURM is the `launcher.slurm` config section itself.
SlurmPolicy = SlurmSection


def policy_of(cfg: ExperimentConfig) -> SlurmPolicy:
    return cfg.launcher.slurm


@dataclass
class JobRequest:
    """One role's job: what runs in each task and what it asks SLURM for."""
    name: str
    command: list[str]
    kind: str = "cpu"               # cpu | gen | trainer | eval
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    threads: int = 1
    exclusive: bool = False
    distributed: bool = False       # export MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
    ready_file: str | None = None
    restart: bool = False


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


def _rewrite_gen_argv(argv: list[str], host: str) -> list[str]:
    """The local launcher picks free ports on its own machine; on a cluster the server picks
    them on its node (port 0: HTTP, and SGLang's NCCL port with gen.backend: sglang) and binds
    an interface other nodes reach. The command stays the role's: `tandem gen serve` or, for
    SGLang, `tandem gen sglang`, which runs `python -m sglang.launch_server` on the job's GPUs
    (CUDA_VISIBLE_DEVICES from SLURM's allocation of gen.tp_size GPUs)."""
    out = list(argv)
    for flag, value in (("--host", host), ("--port", "0"), ("--nccl-port", "0")):
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def job_requests(cfg: ExperimentConfig, exp: ExpDir, resume: bool, plan=None,
                 specs: list[RoleSpec] | None = None) -> list[JobRequest]:
    """The jobs of an experiment in start order (`specs`, default `role_specs`), sized by the
    allocation plan (default `plan_for(cfg)`)."""
    from .plan import plan_for
    from .run import role_specs

    plan = plan or plan_for(cfg)
    policy = policy_of(cfg)
    if cfg.gen.num_servers != plan.num_servers:
        # The plan decides; roles read the count from <exp>/config.yaml, so they must agree.
        cfg.gen.num_servers = plan.num_servers
        save_resolved(cfg, exp.root)
    per_node: dict[int, int] = {}
    for r in plan.trainer_ranks:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    if len(set(per_node.values())) > 1:
        raise LaunchError(f"the plan puts trainer ranks unevenly on nodes ({per_node}); one SLURM job "
                          f"needs the same number of tasks on each node. Choose launcher.nodes / "
                          f"gen_train_ratio so training gets whole nodes or part of a single node")
    ranks_per_node = next(iter(per_node.values()))
    whole = cfg.launcher.slurm.exclusive
    out = []
    for spec in specs if specs is not None else role_specs(cfg, exp, resume):
        common = dict(name=spec.name, threads=spec.threads, ready_file=spec.ready_file, restart=spec.restart)
        if spec.name.startswith("gen-"):
            out.append(JobRequest(command=tandem_argv(*_rewrite_gen_argv(spec.argv, policy.bind_host)),
                                  kind="gen", gpus_per_node=plan.gen_tp,
                                  exclusive=whole and plan.gen_tp == plan.gpus_per_node, **common))
        elif spec.name.startswith("trainer"):
            out.append(JobRequest(command=tandem_argv(*spec.argv), kind="trainer", nodes=len(per_node),
                                  tasks_per_node=ranks_per_node, gpus_per_node=ranks_per_node,
                                  exclusive=whole and ranks_per_node == plan.gpus_per_node,
                                  distributed=True, **common))
        else:
            out.append(JobRequest(command=tandem_argv(*spec.argv), **common))
    return out
