"""The roles of an experiment, in start order: the one list every backend starts.

A role is a command (`tandem <role> --exp DIR ...`) plus what any backend needs to know to
start it well: its kind (which decides how a backend sizes it: CPU job, GPU server, the
distributed trainer), how many threads it may use, the `<exp>/services/` file that says it is
ready, and whether a crash may be answered with a restart. Backends add only their own
details (local: CPU sets and GPU ids from the plan; SLURM: job sizes, the node's address).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.protocol import POLICY_ADAPTER, ExpDir, free_port

from .config import ConfigError, ExperimentConfig

# SGLang loads and warms up a GPU model (minutes for 14B), not seconds.
SGLANG_READY_TIMEOUT_S = 1800.0
# The generation servers' bearer keys under <exp>/keys/ (the names travel in RegisterServer).
GEN_API_KEY, GEN_ADMIN_KEY = "gen-api-key", "gen-admin-api-key"
# Start order; consecutive roles of one stage form a wave started (and awaited) together.
KINDS = ("controller", "reward", "gen", "trainer", "rollout", "eval")
# A kind's stage (experiment_roles: why); a resumed trainer is moved after the servers.
STAGES = {"controller": 0, "reward": 0, "gen": 1, "trainer": 1, "rollout": 3}


@dataclass
class Role:
    name: str                       # e.g. "gen-0"; its console is logs/<name>.console
    command: list[str]              # the whole command line (tandem_argv(...) for real roles)
    kind: str = "cpu"               # one of KINDS, or "cpu" for anything else
    index: int = 0                  # gen-<index>, rollout-<index>
    threads: int = 1
    ready_file: str | None = None   # services/<file>.json: written when the role is ready
    restart: bool = False           # a crash may be answered with a restart (servers that rejoin)
    max_restarts: int = 3
    ready_timeout_s: float | None = None   # None: the backend's default
    # Roles of one stage start together; a stage starts once the one before is ready (None:
    # the kind's, STAGES).
    stage: int | None = None

    def __post_init__(self):
        if self.stage is None:
            self.stage = STAGES.get(self.kind, 0)


def tandem_argv(*args: str) -> list[str]:
    """`tandem ARGS` with the launcher's own interpreter, so every role runs the same install."""
    return [sys.executable, "-m", "tandem.launcher.cli", *args]


def gpu_layout(cfg: ExperimentConfig):
    """With gen.backend: sglang, the plan that places the servers on GPUs (None otherwise).

    The plan decides the server count (one per gen.tp_size generation GPUs) and the trainer world
    (one rank per training GPU) on every backend; the local backend also gives each server and
    each trainer rank their GPUs from it, on this one machine, so it refuses a plan of several
    nodes."""
    if cfg.gen.backend != "sglang":
        return None
    from .plan import plan_for

    plan = plan_for(cfg, place_cpus=False)
    cfg.gen.num_servers = plan.num_servers
    la = cfg.launcher
    if la.backend == "local":
        if la.nodes != 1:
            raise ConfigError(f"launcher.nodes={la.nodes}: the local backend runs on this machine only; "
                              f"use launcher.backend: slurm for several nodes")
        visible = visible_gpus()
        if visible and len(visible) < la.gpus_per_node:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(f"launcher.gpus_per_node={la.gpus_per_node}: the plan places the roles on "
                              f"{la.gpus_per_node} GPUs, but this launcher sees {len(visible)}"
                              + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
                              + f"; set launcher.gpus_per_node={len(visible)}")
    return plan


def visible_gpus() -> list[str]:
    """The GPUs the local launcher may place roles on, as its children must name them: the
    entries of its own CUDA_VISIBLE_DEVICES (a shared machine's share, a SLURM allocation's
    GPUs: the plan's GPU i is the i-th of them), else 0..N-1 for the N devices torch sees.
    CUDA reads the list up to its first invalid entry ("-1" hides them all)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        out = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry or entry.startswith("-"):
                break
            out.append(entry)
        return out
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:   # no torch or no driver: the plan's own numbering
        return []


def experiment_roles(cfg: ExperimentConfig, exp: ExpDir, resume: bool, host: str = "127.0.0.1",
                     pick_port: Callable[[], int] = free_port) -> list[Role]:
    """Controller, reward service, generation servers, trainer, rollout workers.

    `host` is the interface generation servers bind and `pick_port` their port: the local
    backend picks free ports once (a restarted server comes back at the same address), a
    cluster backend passes 0 so the server picks one on whatever node it lands.

    Stages: the controller and the reward service need nothing; the servers and the trainer
    need the controller, and start together (each loads its model on its own devices), except
    on --resume, where the trainer publishes its checkpoint's weights before it is ready and so
    starts once the servers are up to receive them (a broadcast needs its receivers); the
    workers need everything."""
    root = str(exp.root)
    roles = [Role("controller-0", tandem_argv("controller", "--exp", root), kind="controller",
                  ready_file="controller", restart=True),
             Role("reward-0", tandem_argv("reward", "serve", "--exp", root), kind="reward",
                  ready_file="reward", restart=True)]
    roles += gen_roles(cfg, exp, host, pick_port)
    roles.append(Role("trainer-0", tandem_argv("trainer", "--exp", root, *(["--resume"] if resume else [])),
                      kind="trainer", threads=cfg.trainer.threads, ready_file="trainer", stage=2 if resume else None))
    roles += [Role(f"rollout-{r}", tandem_argv("rollout", "--exp", root, "--rank", str(r)), kind="rollout",
                   index=r, restart=True) for r in range(cfg.rollout.num_workers)]
    return roles


def gen_roles(cfg: ExperimentConfig, exp: ExpDir, host: str, pick_port: Callable[[], int]) -> list[Role]:
    """The generation servers: `tandem gen serve` (embedded, CPU) or, with gen.backend: sglang,
    `tandem gen sglang` (rollout/sglang_role.py: a supervised `python -m sglang.launch_server`).
    Both take the same key files and announce `<exp>/services/gen-<i>.json`; the lifecycle then
    registers each with the controller."""
    gpu_layout(cfg)            # the plan's server count
    return [gen_role(cfg, exp, i, host, pick_port) for i in range(cfg.gen.num_servers)]


def gen_role(cfg: ExperimentConfig, exp: ExpDir, i: int, host: str, pick_port: Callable[[], int]) -> Role:
    """Generation server `gen-<i>` (also one the elastic split adds during a run)."""
    sglang = cfg.gen.backend == "sglang"
    argv = ["gen", "sglang" if sglang else "serve", "--model", cfg.experiment.model, "--host", host,
            "--port", str(pick_port())]
    if sglang:
        argv += ["--nccl-port", str(pick_port())]
    argv += ["--api-key-file", str(exp.keys / GEN_API_KEY), "--admin-api-key-file",
             str(exp.keys / GEN_ADMIN_KEY), "--exp", str(exp.root), "--rank", str(i)]
    if cfg.trainer.lora.adapter_sync:   # serve version 0's adapter under the name requests give
        argv += ["--lora-paths", f"{POLICY_ADAPTER}={exp.initial_adapter}"]
    # SGLang runs a scheduler per TP rank, a tokenizer/HTTP process and a detokenizer, each
    # busy on its own core: a SLURM job asks for that many CPUs (the plan's pool locally).
    threads = max(cfg.gen.threads, cfg.gen.tp_size + 2) if sglang else cfg.gen.threads
    return Role(f"gen-{i}", tandem_argv(*argv), kind="gen", index=i, threads=threads, ready_file=f"gen-{i}",
                restart=True, ready_timeout_s=SGLANG_READY_TIMEOUT_S if sglang else None)


def eval_role(exp: ExpDir, tag: str) -> Role:
    """Greedy accuracy of the policy the generation servers hold now, into eval-<tag>.json."""
    return Role(f"eval-{tag}", tandem_argv("eval", "--exp", str(exp.root), "--out", str(eval_output(exp, tag)),
                                              "--tag", tag),
                kind="eval")


def eval_output(exp: ExpDir, tag: str):
    return exp.root / f"eval-{tag}.json"


def waves(roles: list[Role]) -> list[list[Role]]:
    """Consecutive roles of one stage are started together and then awaited, so 48 servers and
    the trainer queue and load their models in parallel, not one after another; stages still
    start in order (services, then servers and trainer, then workers)."""
    out: list[list[Role]] = []
    for role in roles:
        if out and out[-1][0].stage == role.stage:
            out[-1].append(role)
        else:
            out.append([role])
    return out
