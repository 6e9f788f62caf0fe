"""The allocation plan: which GPUs generate, which train, and where the CPU roles run.

Generation and training get disjoint GPUs in the configured ratio (`launcher.gen_train_ratio`,
AReaL's 3:1). Whole nodes per role when the ratio divides the node count, because a node shared
by two roles makes both fight over its NVLink and host memory; otherwise the split falls inside
one node, rounded so no tensor-parallel group straddles a role or a node boundary. Everything
that cannot work (TP larger than a node, a trainer world not divisible by TP x PP, a ratio
that leaves a role with no GPU) is a `PlanError` naming the keys to change, before any job is
submitted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.launcher.config import ConfigError, ExperimentConfig
from tandem.launcher.placement import CpuPlacement, available_cpus, format_ranges, place_cpus


class PlanError(ConfigError):
    """The cluster shape cannot host the requested layout; the message says which keys conflict."""


@dataclass(frozen=True)
class ServerSlot:
    """One generation server: its index, node, and the node-local GPU ids it owns."""
    index: int
    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    node: int
    gpu: int


@dataclass
class Plan:
    nodes: int
    gpus_per_node: int
    ratio: tuple[int, int]
    # "whole-node" or "gpu-level".
    split: str
    gen_gpus: int
    train_gpus: int
    gen_tp: int
    train_tp: int
    train_pp: int
    servers: list[ServerSlot] = field(default_factory=list)
    trainer_ranks: list[TrainerRank] = field(default_factory=list)
    # role -> where it runs (CPU roles).
    cpu_roles: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Local backend: the CPU pools of every role (launcher.placement); None on SLURM.
    cpus: CpuPlacement | None = None
    # False when no role uses a GPU (local backend with embedded CPU servers).
    uses_gpus: bool = True
    # trainer.expert_parallel: each MoE layer's experts over this many of the data-parallel ranks.
    train_ep: int = 1

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    @property
    def trainer_world(self) -> int:
        return self.train_gpus

    @property
    def train_dp(self) -> int:
        return self.train_gpus // (self.train_tp * self.train_pp)

    @property
    def gen_nodes(self) -> list[int]:
        return sorted({s.node for s in self.servers})

    @property
    def train_nodes(self) -> list[int]:
        return sorted({r.node for r in self.trainer_ranks})

    def node_roles(self) -> list[tuple[int, int, int]]:
        """(node, generation GPUs on it, training GPUs on it) for every node."""
        gen = [0] * self.nodes
        train = [0] * self.nodes
        for s in self.servers:
            gen[s.node] += len(s.gpus)
        for r in self.trainer_ranks:
            train[r.node] += 1
        return [(n, gen[n], train[n]) for n in range(self.nodes)]

    def cuda_visible_devices(self, role: str, index: int) -> str:
        """CUDA_VISIBLE_DEVICES for generation server `index` or trainer rank `index`."""
        if role == "gen":
            return ",".join(map(str, self.servers[index].gpus))
        return str(self.trainer_ranks[index].gpu)

    def trainer_devices(self, rank: int) -> str:
        """CUDA_VISIBLE_DEVICES of trainer rank `rank` started as torchrun starts it (and as its
        SLURM task sees its node): every training GPU of its node, of which the rank takes the one
        at its LOCAL_RANK."""
        node = self.trainer_ranks[rank].node
        return ",".join(str(r.gpu) for r in self.trainer_ranks if r.node == node)


def parse_ratio(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise PlanError(f"launcher.gen_train_ratio: must look like '3:1', got {text!r}") from None
    if len(parts) != 2 or a < 1 or b < 1:
        raise PlanError(f"launcher.gen_train_ratio: must be two positive integers like '3:1', got {text!r}")
    return a, b


def _check_tp(key: str, tp: int, gpus_per_node: int) -> None:
    if tp < 1:
        raise PlanError(f"{key}={tp}: must be >= 1")
    if tp > gpus_per_node:
        raise PlanError(f"{key}={tp} is larger than a node (launcher.gpus_per_node={gpus_per_node}): "
                        f"a tensor-parallel group must stay inside one node's NVLink domain")
    if gpus_per_node % tp:
        raise PlanError(f"{key}={tp} does not divide launcher.gpus_per_node={gpus_per_node}: "
                        f"some tensor-parallel group would straddle two nodes")


def make_plan(nodes: int, gpus_per_node: int, ratio: str | tuple[int, int], gen_tp: int = 1,
              train_tp: int = 1, train_pp: int = 1, cpu_where: str = "a CPU job (no GPUs)",
              rollout_workers: int = 1, train_ep: int = 1) -> Plan:
    """Split `nodes x gpus_per_node` GPUs between generation servers and trainer ranks."""
    a, b = parse_ratio(ratio) if isinstance(ratio, str) else ratio
    if nodes < 1:
        raise PlanError(f"launcher.nodes={nodes}: must be >= 1")
    if gpus_per_node < 1:
        raise PlanError(f"launcher.gpus_per_node={gpus_per_node}: there are no GPUs to split "
                        f"between generation and training")
    if train_pp < 1:
        raise PlanError(f"trainer.pipeline_parallel={train_pp}: must be >= 1")
    _check_tp("gen.tp_size", gen_tp, gpus_per_node)
    _check_tp("trainer.tensor_parallel", train_tp, gpus_per_node)
    total = nodes * gpus_per_node
    ratio_txt = f"{a}:{b}"
    if (nodes * a) % (a + b) == 0:
        split = "whole-node"
        gen_gpus = nodes * a // (a + b) * gpus_per_node
    else:
        # Round the generation share to the nearest whole TP group of both roles, so every
        # server and every trainer TP group sits inside one node and one role.
        split = "gpu-level"
        unit = math.lcm(gen_tp, train_tp)
        gen_gpus = math.floor(total * a / (a + b) / unit + 0.5) * unit
    train_gpus = total - gen_gpus
    if gen_gpus <= 0 or train_gpus <= 0:
        starved = "generation" if gen_gpus <= 0 else "training"
        raise PlanError(f"launcher.gen_train_ratio={ratio_txt} on {nodes} node(s) x {gpus_per_node} GPUs "
                        f"(gen.tp_size={gen_tp}, trainer.tensor_parallel={train_tp}) leaves {starved} "
                        f"with no GPU; add nodes or change the ratio")
    if train_gpus % (train_tp * train_pp):
        raise PlanError(f"trainer world size {train_gpus} (the training share of {total} GPUs at "
                        f"{ratio_txt}) is not divisible by trainer.tensor_parallel x "
                        f"trainer.pipeline_parallel = {train_tp} x {train_pp}; change the ratio, the "
                        f"node count or the parallel layout")
    _check_expert_parallel(f"trainer world size {train_gpus}", train_gpus, train_tp, train_pp, train_ep)
    plan = Plan(nodes=nodes, gpus_per_node=gpus_per_node, ratio=(a, b), split=split,
                gen_gpus=gen_gpus, train_gpus=train_gpus, gen_tp=gen_tp, train_tp=train_tp,
                train_pp=train_pp, train_ep=train_ep)
    for i in range(gen_gpus // gen_tp):
        first = i * gen_tp
        node, local = divmod(first, gpus_per_node)
        plan.servers.append(ServerSlot(i, node, tuple(range(local, local + gen_tp))))
    for r in range(train_gpus):
        node, local = divmod(gen_gpus + r, gpus_per_node)
        plan.trainer_ranks.append(TrainerRank(r, node, local))
    plan.cpu_roles = {"controller": cpu_where, "reward service": cpu_where,
                      f"rollout workers (x{rollout_workers})": cpu_where}
    actual = gen_gpus / train_gpus
    if abs(actual - a / b) > 1e-9:
        plan.notes.append(f"requested {ratio_txt}, got {gen_gpus}:{train_gpus} GPUs "
                          f"({actual:.2f}:1) after rounding to whole TP groups")
    return plan


def plan_for(cfg: ExperimentConfig, place_cpus: bool = True) -> Plan:
    """The plan of an experiment config (its launcher, gen and trainer sections).

    With the local backend it also places every role on this machine's CPUs (`place_cpus`;
    the simulator, which plans clusters, does not ask for that)."""
    la = cfg.launcher
    where = "this machine" if la.backend == "local" else "a CPU job (no GPUs)"
    plan = make_plan(la.nodes, la.gpus_per_node, la.gen_train_ratio, gen_tp=cfg.gen.tp_size,
                     train_tp=cfg.trainer.tensor_parallel, train_pp=cfg.trainer.pipeline_parallel,
                     cpu_where=where, rollout_workers=cfg.rollout.num_workers,
                     train_ep=cfg.trainer.expert_parallel)
    if place_cpus:
        plan.cpus = cpu_placement_for(cfg)
    if plan.cpus is not None:
        services = f"CPUs {format_ranges(plan.cpus.services)} (light services pool)"
        plan.cpu_roles = {k: services for k in plan.cpu_roles}
    plan.uses_gpus = uses_gpus(cfg)
    if la.backend == "slurm" and cfg.gen.num_servers not in (1, plan.num_servers):
        plan.notes.append(f"gen.num_servers={cfg.gen.num_servers} is ignored on slurm: the plan "
                          f"starts {plan.num_servers} servers")
    if la.cpus.trainer_ranks != 1 and (la.backend == "slurm" or cfg.gen.backend == "sglang"):
        plan.notes.append(f"launcher.cpus.trainer_ranks={la.cpus.trainer_ranks} is ignored with GPUs: the "
                          f"plan starts {plan.trainer_world} trainer ranks, one per training GPU")
    return plan


def uses_gpus(cfg: ExperimentConfig) -> bool:
    """False for one machine running CPU roles only (embedded servers, the torch trainer): its GPU
    plan would describe GPUs nothing uses, so neither `tandem plan` draws it nor a launch checks it."""
    la = cfg.launcher
    return not (la.backend == "local" and la.nodes == 1 and cfg.gen.backend == "embedded"
                and cfg.trainer.backend == "torch")


def local_trainer_world(cfg: ExperimentConfig) -> int:
    """How many trainer ranks the local backend starts on this machine.

    With GPUs (gen.backend: sglang) the plan decides, as it decides the SLURM trainer job's tasks:
    one rank per training GPU. The CPU miniature has no GPUs to count, so
    `launcher.cpus.trainer_ranks` says (1 unless set: the GPU defaults, 8 GPUs at 3:1, would give
    every small run two ranks and refuse a two-core machine). Either way the world must split
    into trainer.tensor_parallel x trainer.pipeline_parallel groups."""
    if cfg.gen.backend == "sglang":
        return plan_for(cfg, place_cpus=False).trainer_world
    world, tp, pp = cfg.launcher.cpus.trainer_ranks, cfg.trainer.tensor_parallel, cfg.trainer.pipeline_parallel
    if world % (tp * pp):
        raise PlanError(f"launcher.cpus.trainer_ranks={world} is not divisible by trainer.tensor_parallel x "
                        f"trainer.pipeline_parallel = {tp} x {pp}: the ranks would not form whole model "
                        f"replicas")
    _check_expert_parallel(f"launcher.cpus.trainer_ranks={world}", world, tp, pp, cfg.trainer.expert_parallel)
    return world


def _check_expert_parallel(what: str, world: int, tp: int, pp: int, ep: int) -> None:
    """Expert parallelism splits each data-parallel group of ranks (megatron-core carves it out of
    data parallelism): trainer.expert_parallel must divide world / (TP x PP)."""
    if ep > 1 and (world // (tp * pp)) % ep:
        raise PlanError(f"trainer.expert_parallel={ep} must divide the trainer's data-parallel size "
                        f"{world // (tp * pp)} ({what} / trainer.tensor_parallel {tp} / "
                        f"trainer.pipeline_parallel {pp}); change the ratio, the node count or the layout")


def cpu_placement_for(cfg, available=None) -> CpuPlacement | None:
    """The local backend's placement of `cfg`, or None when pinning is off or roles run on SLURM.
    The training pool is split into one set per trainer rank (`local_trainer_world`)."""
    la = cfg.launcher
    if la.backend != "local" or not la.cpus.pin:
        return None
    return place_cpus(available_cpus() if available is None else available, num_servers=cfg.gen.num_servers,
                      trainer_ranks=local_trainer_world(cfg), ratio=parse_ratio(la.gen_train_ratio),
                      gen=la.cpus.gen, train=la.cpus.train, services=la.cpus.services)


def render_cpus(cpus: CpuPlacement, console) -> None:
    """The local backend's CPU pools: one row per server, trainer rank and the services."""
    from rich.table import Table

    where = "launcher.cpus" if cpus.source == "launcher.cpus" else "planned"
    table = Table(title=f"CPU placement ({where}): {len(cpus.available)} CPUs "
                        f"({format_ranges(list(cpus.available))}) on this machine")
    for c in ("pool", "CPUs", "threads", "roles"):
        table.add_column(c)
    for row in cpus.rows():
        table.add_row(*row)
    console.print(table)
    for note in (*cpus.notes, *cpus.shared_pools()):
        console.print(f"note: {note}")


def render(plan: Plan, console=None) -> None:
    """Print the plan: a summary and one row per run of identically used nodes."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if plan.cpus is not None:
        render_cpus(plan.cpus, console)
    if not plan.uses_gpus:
        console.print("no GPU roles: embedded generation servers and the torch trainer run on the CPUs above")
        return
    a, b = plan.ratio
    summary = Table(title=f"Allocation plan: {plan.nodes} nodes x {plan.gpus_per_node} GPUs, "
                          f"ratio {a}:{b} ({plan.split} split)")
    for c in ("role", "GPUs", "nodes", "layout"):
        summary.add_column(c)
    summary.add_row("generation", str(plan.gen_gpus), format_ranges(plan.gen_nodes),
                    f"{plan.num_servers} servers x TP {plan.gen_tp}")
    summary.add_row("training", str(plan.train_gpus), format_ranges(plan.train_nodes),
                    f"world {plan.trainer_world} = TP {plan.train_tp} x PP {plan.train_pp} "
                    f"x DP {plan.train_dp}" + (f" (experts: EP {plan.train_ep})" if plan.train_ep > 1 else ""))
    for role, where in plan.cpu_roles.items():
        summary.add_row(role, "0", "-", where)
    console.print(summary)
    nodes = Table(title="Per node")
    for c in ("nodes", "generation GPUs", "servers", "training GPUs", "trainer ranks"):
        nodes.add_column(c)
    rows = plan.node_roles()
    by_node_servers: dict[int, list[int]] = {}
    for s in plan.servers:
        by_node_servers.setdefault(s.node, []).append(s.index)
    by_node_ranks: dict[int, list[int]] = {}
    for r in plan.trainer_ranks:
        by_node_ranks.setdefault(r.node, []).append(r.rank)
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1][1:] == rows[i][1:]:
            j += 1
        node_ids = list(range(rows[i][0], rows[j][0] + 1))
        servers = sum((by_node_servers.get(n, []) for n in node_ids), [])
        ranks = sum((by_node_ranks.get(n, []) for n in node_ids), [])
        nodes.add_row(format_ranges(node_ids), str(rows[i][1]), format_ranges(servers), str(rows[i][2]),
                      format_ranges(ranks))
        i = j + 1
    console.print(nodes)
    for note in plan.notes:
        console.print(f"note: {note}")
