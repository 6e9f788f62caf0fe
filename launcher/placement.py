"""CPU placement for the local backend: disjoint CPU pools, as a cluster has disjoint GPU pools.

On a cluster the plan gives generation and training their own GPUs, so neither slows the other
and asynchrony recovers the time each pool would idle. On one machine the same holds only if
the roles do not share cores: this module splits the CPUs this process may use into a
generation pool (divided between `gen.num_servers` servers), a training pool (one set per
trainer rank) and a pool for the light services (controller, reward service, rollout workers,
evaluation and the launcher itself). The local supervisor pins every role to its set
(`os.sched_setaffinity`) and sizes its threads to it.

Defaults (docs/plan.md, "CPU placement"):
- 1 CPU: every role shares it (noted: not a faithful miniature);
- 2 CPUs: generation one, training the other, the light services on the generation CPU. They
  work in step with generation (requests, grading as groups finish), so whatever they cost is
  part of the generation cost in a synchronous run and in an asynchronous one alike, and the
  trainer's CPU stays its own;
- more: a few whole cores for the light services (at least 1, at least n/16, more when that
  lets the rest split exactly), the rest split between generation and training in
  `launcher.gen_train_ratio` (3:1), whole physical cores per pool (hyper-thread siblings stay
  together).
`launcher.cpus.gen/train/services` override the split; mistakes are `PlacementError`s naming
the key, the CPUs and the machine.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from tandem.launcher.config import ConfigError, parse_cpus

# The CPUs this process could use when it started, before the launcher pinned itself to the
# light services' pool: placements computed later in the same process still see the machine.
_STARTUP_CPUS = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
CPUS_ENV = "TANDEM_CPUS"


class PlacementError(ConfigError):
    """The requested CPU placement does not fit this machine or contradicts itself."""


def format_ranges(cpus) -> str:
    """Integer ids (CPUs, nodes, GPUs) -> "0-3,6", the syntax of Cpus_allowed_list in /proc/<pid>/status."""
    xs = sorted(cpus)
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process was allowed to run on when it started."""
    return _STARTUP_CPUS or tuple(range(os.cpu_count() or 1))


def physical_cores(cpus, sysfs: Path = Path("/sys/devices/system/cpu")) -> list[tuple[int, ...]]:
    """`cpus` grouped by physical core (hyper-thread siblings together), in CPU order."""
    allowed = set(cpus)
    groups: dict[tuple[int, ...], None] = {}
    for c in sorted(allowed):
        try:
            text = (sysfs / f"cpu{c}" / "topology" / "thread_siblings_list").read_text().strip()
            sib = tuple(x for x in parse_cpus(text) if x in allowed) or (c,)
        except (OSError, ConfigError):
            sib = (c,)
        groups.setdefault(sib, None)
    return sorted(groups, key=lambda g: g[0])


@dataclass(frozen=True)
class CpuPlacement:
    """Which CPUs each local role may run on, and how many threads it should use."""
    available: tuple[int, ...]
    gen: tuple[int, ...]
    train: tuple[int, ...]
    services: tuple[int, ...]
    servers: tuple[tuple[int, ...], ...]
    trainer_ranks: tuple[tuple[int, ...], ...]
    # "planned" (the defaults above) or "launcher.cpus" (the experiment's override).
    source: str = "planned"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def cpus_for(self, role: str) -> tuple[int, ...]:
        """CPU set of a role named as the local launcher names them (gen-0, trainer-0, reward-0...)."""
        kind, _, index = role.rpartition("-")
        if kind == "gen" and index.isdigit() and int(index) < len(self.servers):
            return self.servers[int(index)]
        if kind == "trainer" and index.isdigit() and int(index) < len(self.trainer_ranks):
            return self.trainer_ranks[int(index)]
        return self.services

    def threads_for(self, role: str) -> int:
        """Compute roles use every CPU of their set; light services one thread each."""
        kind = role.rpartition("-")[0]
        return len(self.cpus_for(role)) if kind in ("gen", "trainer") else 1

    def shared_pools(self) -> list[str]:
        """Pools that overlap (only the light services may share one)."""
        out = []
        if set(self.gen) & set(self.train):
            out.append("generation and training share CPUs")
        if set(self.services) & set(self.gen):
            out.append("light services share the generation pool")
        if set(self.services) & set(self.train):
            out.append("light services share the training pool")
        return out

    def record(self) -> dict:
        """A metrics record: the simulator's calibration reads which pools a run shared."""
        return {"event": "cpu_placement", "source": self.source, "available": format_ranges(self.available),
                "gen": format_ranges(self.gen), "train": format_ranges(self.train),
                "services": format_ranges(self.services),
                "servers": [format_ranges(s) for s in self.servers],
                "trainer_ranks": [format_ranges(s) for s in self.trainer_ranks], "shared": self.shared_pools()}

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(pool, CPUs, threads, who) for `tandem plan`."""
        rows = [(f"generation server {i}", format_ranges(s), str(len(s)), f"gen-{i}")
                for i, s in enumerate(self.servers)]
        rows += [(f"trainer rank {r}", format_ranges(s), str(len(s)), f"trainer-{r}")
                 for r, s in enumerate(self.trainer_ranks)]
        rows.append(("light services", format_ranges(self.services), "1 each",
                     "controller, reward, rollout workers, eval, launcher"))
        return rows


def split_cpus(cpus: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous, as-equal-as-possible chunks (the first ones one CPU larger)."""
    size, extra = divmod(len(cpus), parts)
    out, i = [], 0
    for p in range(parts):
        n = size + (1 if p < extra else 0)
        out.append(cpus[i:i + n])
        i += n
    return tuple(out)


def _flat(cores) -> tuple[int, ...]:
    return tuple(sorted(c for core in cores for c in core))


def service_cores(cores: int, ratio: tuple[int, int]) -> int:
    """Whole cores reserved for the light services on a machine of `cores` (>= 3) cores."""
    base, cap = max(1, cores // 16), max(1, cores // 4)
    a, b = ratio
    return next((k for k in range(base, cap + 1) if (cores - k) % (a + b) == 0), base)


def default_pools(cores: list[tuple[int, ...]], ratio: tuple[int, int]) -> tuple[tuple, tuple, tuple, list[str]]:
    """(gen, train, services, notes) for the planned placement."""
    n = len(cores)
    if n == 1:
        only = _flat(cores)
        return only, only, only, [f"one core ({format_ranges(only)}): every role shares it, so generation "
                                  f"and training slow each other (not a faithful miniature)"]
    if n == 2:
        gen, train = cores[0], cores[1]
        return gen, train, gen, ["two cores: the light services share the generation core; they work in "
                                 "step with generation, and the trainer's core stays its own"]
    s = service_cores(n, ratio)
    rest = cores[s:]
    a, b = ratio
    g = min(len(rest) - 1, max(1, math.floor(len(rest) * a / (a + b) + 0.5)))
    return _flat(rest[:g]), _flat(rest[g:]), _flat(cores[:s]), []


def place_cpus(available, *, num_servers: int = 1, trainer_ranks: int = 1, ratio: tuple[int, int] = (3, 1),
               gen: str = "", train: str = "", services: str = "",
               cores: list[tuple[int, ...]] | None = None) -> CpuPlacement:
    """The placement on `available` CPUs; `gen`/`train`/`services` are launcher.cpus overrides."""
    avail = tuple(sorted(set(available)))
    if not avail:
        raise PlacementError("no CPU is available to this process")
    notes: list[str] = []
    machine = f"this process may use {len(avail)} CPU(s): {format_ranges(avail)}"
    if gen or train or services:
        if not (gen and train):
            raise PlacementError("launcher.cpus: set both gen and train (services is optional)")
        g, t = parse_cpus(gen, "launcher.cpus.gen"), parse_cpus(train, "launcher.cpus.train")
        s = parse_cpus(services, "launcher.cpus.services") if services else ()
        for key, cpus in (("gen", g), ("train", t), ("services", s)):
            missing = sorted(set(cpus) - set(avail))
            if missing:
                raise PlacementError(f"launcher.cpus.{key}={format_ranges(cpus)}: CPU(s) {format_ranges(missing)} "
                                     f"are not available ({machine})")
        both = sorted(set(g) & set(t))
        if both:
            raise PlacementError(f"launcher.cpus.gen={format_ranges(g)} and launcher.cpus.train={format_ranges(t)} "
                                 f"overlap on CPU(s) {format_ranges(both)}: generation and training need "
                                 f"disjoint pools (only services may share one)")
        if not s:
            left = tuple(c for c in avail if c not in set(g) | set(t))
            s = left or g
            notes.append(f"light services on {'the CPUs left over' if left else 'the generation pool'} "
                         f"({format_ranges(s)})")
        source = "launcher.cpus"
    else:
        g, t, s, notes = default_pools(cores if cores is not None else physical_cores(avail), ratio)
        source = "planned"
    if num_servers > len(g):
        raise PlacementError(f"gen.num_servers={num_servers} needs at least {num_servers} CPUs in the generation "
                             f"pool, which has {len(g)} ({format_ranges(g)}; {machine}); lower gen.num_servers, "
                             f"set launcher.cpus.gen, or launcher.cpus.pin=false to let roles share every CPU")
    if trainer_ranks > len(t):
        raise PlacementError(f"{trainer_ranks} trainer rank(s) need at least {trainer_ranks} CPUs in the training "
                             f"pool, which has {len(t)} ({format_ranges(t)}; {machine}); set launcher.cpus.train, "
                             f"fewer ranks (launcher.cpus.trainer_ranks; with GPUs, launcher.gen_train_ratio) "
                             f"or launcher.cpus.pin=false")
    return CpuPlacement(available=avail, gen=g, train=t, services=s, servers=split_cpus(g, num_servers),
                        trainer_ranks=split_cpus(t, trainer_ranks), source=source, notes=tuple(notes))


def pin_from_env() -> None:
    """In a role process started by the local launcher: pin this process to $TANDEM_CPUS.

    Called first thing in `tandem`'s main, before any thread exists, so every thread the role
    starts later (torch's pool, ZeroMQ's I/O thread) inherits the set.
    """
    text = os.environ.get(CPUS_ENV)
    if text and hasattr(os, "sched_setaffinity"):
        cpus = parse_cpus(text, CPUS_ENV)
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            raise PlacementError(f"${CPUS_ENV}={text}: cannot pin this process to CPU(s) "
                                 f"{format_ranges(cpus)} ({e.strerror}); the machine allows "
                                 f"{format_ranges(os.sched_getaffinity(0))}") from None
