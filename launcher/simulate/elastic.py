"""`tandem simulate --elastic`: what moving GPUs between generation and training during the run
(`launcher.elastic`) would gain, predicted before the run.

Output lengths grow during RL (`simulate.length_growth`), so the split that is fastest at the
start is not the fastest at the end. The run of `trainer.total_steps` steps is cut into a few
phases; each phase is simulated on every candidate split (every split one unit apart that the
plan accepts on the configured nodes: a node on a cluster, a tensor-parallel group of GPUs on
one node), on the same drawn lengths grown to that phase's part of the run, so differences come
from the configuration. Then three runs are priced from these tables:

- **fixed at the start**: the split fastest in the first phase, kept for the run (all a user
  can know before the run, and what `tandem plan --suggest` would pick);
- **fixed in hindsight**: the split with the shortest whole run (needs knowing the future);
- **elastic**: starts at the first, and every `launcher.elastic_every_steps` steps applies the
  runtime's rule (`launcher/elastic_policy.py`: one neighbouring move, only for a gain over
  `launcher.elastic_min_gain`) to what it has measured: the previous phase's speeds (the
  first phase's before that), never the phase it is in. Each move stops training progress
  for `move_s` (below).

Approximations (also in docs/simulator.md): each phase is simulated independently from an empty
pipeline and priced at its steady rate (after the warm-up), so the refill after a move is part
of `move_s`, not simulated; lengths grow continuously within a phase's simulation, but the phase
is priced at one rate; the elastic run knows every split's rate of the previous phase, as a
simulator calibrated on its own windows would predict them, not measured ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.launcher.config import ConfigError, ExperimentConfig
from tandem.launcher.elastic_policy import choose_split
from tandem.launcher.plan import PlanError, make_plan
from tandem.launcher.simulate.engine import SimulationError
from tandem.launcher.simulate.scenario import build, lengths_for, simulate, with_overrides

# Assumption: seconds before a moved unit works again, beyond the weight and checkpoint transfers
# priced from the costs: an SGLang server's start (process, CUDA context, graph capture: tens of
# seconds) and the trainer's ranks re-forming their torch.distributed group, in parallel; the
# embedded CPU server starts in seconds.
RESTART_S = {"sglang": 60.0, "embedded": 5.0}
# At most this many phases: each is one simulation per candidate split.
DEFAULT_MAX_PHASES = 6


@dataclass(frozen=True)
class Split:
    """One candidate: generation and training GPUs, as a ratio `with_overrides` accepts."""
    ratio: str
    gen_gpus: int
    train_gpus: int

    @property
    def label(self) -> str:
        g, t = self.gen_gpus, self.train_gpus
        d = math.gcd(g, t)
        return f"{g // d}:{t // d} ({g}+{t} GPUs)"


def candidate_splits(cfg: ExperimentConfig) -> list[Split]:
    """Every split one unit apart that the plan accepts, by generation share. A unit is a node
    when there are several (the runtime moves whole nodes), else the smallest group of GPUs
    both roles' tensor parallelism allows."""
    if cfg.gen.backend != "sglang":
        raise ConfigError("--elastic prices splits of GPU nodes (gen.backend: sglang); the embedded CPU "
                          "servers' speed on another CPU set is not modelled")
    if cfg.simulate.colocated:
        raise ConfigError("--elastic needs separate generation and training pools (simulate.colocated: false)")
    la, tp, pp = cfg.launcher, cfg.trainer.tensor_parallel, cfg.trainer.pipeline_parallel
    total = la.nodes * la.gpus_per_node
    unit = la.gpus_per_node if la.nodes > 1 else math.lcm(cfg.gen.tp_size, tp)
    out = []
    for gen in range(unit, total, unit):
        try:
            plan = make_plan(la.nodes, la.gpus_per_node, (gen, total - gen), gen_tp=cfg.gen.tp_size,
                             train_tp=tp, train_pp=pp)
        except PlanError:
            continue
        if plan.gen_gpus == gen:
            out.append(Split(f"{gen}:{total - gen}", plan.gen_gpus, plan.train_gpus))
    if len(out) < 2:
        raise ConfigError(f"--elastic: {la.nodes} node(s) x {la.gpus_per_node} GPUs (gen.tp_size="
                          f"{cfg.gen.tp_size}, trainer TP x PP = {tp} x {pp}) allow "
                          f"{len(out)} split(s) of whole {'nodes' if la.nodes > 1 else 'TP groups'}; "
                          f"an elastic split needs two or more (add nodes)")
    return out


def move_seconds(cfg: ExperimentConfig, calibration=None) -> float:
    """Training progress lost to one move: the trainer saves its state and its re-formed ranks
    read it back (two checkpoints' worth through the filesystem), the new server loads the
    current weights, and both restart (RESTART_S). Priced in full as a stall of the run."""
    costs = build(cfg, calibration).costs
    return RESTART_S.get(cfg.gen.backend, RESTART_S["sglang"]) + 2 * costs.checkpoint_s + costs.load_s


@dataclass
class ElasticPrediction:
    splits: list[Split]
    total_steps: int
    every_steps: int
    min_gain: float
    growth: float
    move_s: float
    # speeds[p][ratio]: steps/hour of each split in phase p (None: could not run).
    speeds: list[dict[str, float | None]]
    start: Split
    hindsight: Split
    seconds: dict[str, float]                 # "start", "hindsight", "elastic"
    # (step, from ratio, to ratio) of every move the elastic run makes.
    moves: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def phases(self) -> int:
        return len(self.speeds)

    def steps_per_hour(self, run: str) -> float:
        return self.total_steps / self.seconds[run] * 3600

    def gain_over(self, run: str) -> float:
        """Elastic's speed-up over `run` ("start" or "hindsight"), as a fraction."""
        return self.seconds[run] / self.seconds["elastic"] - 1

    def by_ratio(self, ratio: str) -> Split:
        return next(s for s in self.splits if s.ratio == ratio)


def phase_count(total_steps: int, every_steps: int, max_phases: int = DEFAULT_MAX_PHASES) -> int:
    """Phases a run of `total_steps` is priced in: one per decision window, at most `max_phases`."""
    return max(1, min(max_phases, math.ceil(total_steps / every_steps)))


def _phase_speeds(cfg: ExperimentConfig, splits: list[Split], phases: int, calibration=None,
                  jobs: int = 1) -> list[dict[str, float | None]]:
    lengths = lengths_for(cfg, cfg.controller.max_staleness)
    # Without growth every phase is the same workload: simulate it once.
    spans = [(p / phases, (p + 1) / phases) for p in range(phases)] if cfg.simulate.length_growth != 1 \
        else [(0.0, 1.0)]
    points = [(cfg, s.ratio, span, calibration, lengths) for span in spans for s in splits]
    if jobs > 1 and len(points) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(jobs, len(points)), mp_context=mp.get_context("fork")) as ex:
            done = list(ex.map(_point, points))
    else:
        done = [_point(p) for p in points]
    tables = [dict(zip([s.ratio for s in splits], done[i * len(splits):(i + 1) * len(splits)], strict=True))
              for i in range(len(spans))]
    return tables * phases if len(tables) == 1 else tables


def _point(args) -> float | None:
    cfg, ratio, span, calibration, lengths = args
    try:
        return simulate(with_overrides(cfg, ratio), calibration, lengths, growth_span=span)[1].steps_per_hour
    except (PlanError, SimulationError, ConfigError):
        return None


def _run_seconds(speeds, total: int, path) -> float:
    """Seconds for steps [0, total) when step s runs at split path(s) and phase s * P // total."""
    P, t = len(speeds), 0.0
    for p in range(P):
        lo, hi = total * p / P, total * (p + 1) / P
        # the split may change at whole steps only; integrate step by step over the phase
        s = math.floor(lo)
        while s < hi:
            part = min(s + 1, hi) - max(s, lo)
            v = speeds[p][path(s)]
            if v is None:
                raise SimulationError(f"split {path(s)} cannot run phase {p + 1} of {P}")
            t += part * 3600 / v
            s += 1
    return t


def predict(cfg: ExperimentConfig, calibration=None, max_phases: int | None = None, jobs: int = 1,
            move_s: float | None = None) -> ElasticPrediction:
    """The three runs (fixed at the start, fixed in hindsight, elastic) over trainer.total_steps,
    in at most `max_phases` phases (default DEFAULT_MAX_PHASES); `move_s` overrides the move's
    price (move_seconds)."""
    la = cfg.launcher
    max_phases = DEFAULT_MAX_PHASES if max_phases is None else max_phases
    if max_phases < 1:
        raise ConfigError(f"--phases must be >= 1, got {max_phases}")
    splits = candidate_splits(cfg)
    total = cfg.trainer.total_steps
    phases = phase_count(total, la.elastic_every_steps, max_phases)
    speeds = _phase_speeds(cfg, splits, phases, calibration, jobs)
    first = {r: v for r, v in speeds[0].items() if v is not None}
    if not first:
        raise SimulationError("no candidate split could be simulated (see `tandem simulate --sweep ratio=...`)")
    start = max(first, key=first.get)
    if move_s is None:
        move_s = move_seconds(with_overrides(cfg, start), calibration)
    return replay(splits, speeds, total, la.elastic_every_steps, la.elastic_min_gain, move_s,
                  cfg.simulate.length_growth)


def replay(splits: list[Split], speeds: list[dict[str, float | None]], total: int, every: int,
           min_gain: float, move_s: float, growth: float = 1.0) -> ElasticPrediction:
    """Price the three runs on per-phase speed tables (steps/hour by split ratio)."""
    first = {r: v for r, v in speeds[0].items() if v is not None}
    start = next(s for s in splits if s.ratio == max(first, key=first.get))
    fixed = {}
    for s in splits:
        try:
            fixed[s.ratio] = _run_seconds(speeds, total, lambda _step, r=s.ratio: r)
        except SimulationError:
            continue
    if start.ratio not in fixed:
        raise SimulationError(f"the first phase's fastest split {start.label} cannot run a later phase")
    hindsight = next(s for s in splits if s.ratio == min(fixed, key=fixed.get))

    # The elastic run: a decision at the start of every window, on the previous phase's speeds.
    order, phases = [s.ratio for s in splits], len(speeds)
    at, moves, path = start.ratio, [], {}
    for step in range(0, total, every):
        known = speeds[max(0, step * phases // total - 1)]
        to = choose_split(order, at, known, min_gain)
        if to is not None:
            moves.append((step, at, to))
            at = to
        for s in range(step, min(step + every, total)):
            path[s] = at
    elastic = _run_seconds(speeds, total, path.__getitem__) + move_s * len(moves)
    return ElasticPrediction(splits=splits, total_steps=total, every_steps=every, min_gain=min_gain,
                             growth=growth, move_s=move_s, speeds=speeds, start=start, hindsight=hindsight,
                             seconds={"start": fixed[start.ratio], "hindsight": fixed[hindsight.ratio],
                                      "elastic": elastic}, moves=moves)
