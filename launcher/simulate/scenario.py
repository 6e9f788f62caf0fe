"""From an experiment config to a simulation: plan the cluster, price the operations, run.

`simulate(cfg)` answers "how fast will this run go"; `sweep(cfg, ratios, etas)` answers "which
split and which eta", simulating every combination on the same drawn workload (same seed, so
differences come from the configuration, not from luck).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from tandem.launcher.config import ConfigError, ExperimentConfig
from tandem.launcher.plan import Plan, PlanError, make_plan, plan_for
from tandem.launcher.simulate.costs import Costs, Layout, physical_costs
from tandem.launcher.simulate.engine import SimResult, SimSetup, Simulation, SimulationError
from tandem.launcher.simulate.hardware import load_gpu, load_model_shape
from tandem.launcher.simulate.records import samples_used
from tandem.launcher.simulate.workload import grow_lengths, sample_lengths
from tandem.trainer.announcements import coalesces_versions


@dataclass
class Scenario:
    cfg: ExperimentConfig
    # None for embedded CPU servers (gen.num_servers of them, no GPU split).
    plan: Plan | None
    layout: Layout
    setup: SimSetup
    costs: Costs
    notes: list[str] = field(default_factory=list)
    # 1/shrink of the cluster is simulated; rates are multiplied back by it.
    shrink: int = 1


# Auto-shrink keeps at least this much of the cluster, so the slice behaves like the whole, and
# rounds the slice's server count by at most this fraction (the load per server changes by it).
MIN_SHRUNK_SERVERS = 4
MIN_SHRUNK_SAMPLES = 1024
MAX_SHRINK_ROUNDING = 0.02


def shrink_factor(requested: int, servers: int, groups: int, n_samples: int) -> int:
    """k dividing the groups per step; the slice runs round(servers / k) servers."""
    if requested:
        if groups % requested:
            raise ConfigError(f"simulate.shrink={requested} must divide trainer.groups_per_step={groups}")
        return requested

    def fits(k: int) -> bool:
        part = servers / k
        return (groups % k == 0 and groups // k * n_samples >= MIN_SHRUNK_SAMPLES
                and round(part) >= MIN_SHRUNK_SERVERS and abs(round(part) - part) <= MAX_SHRINK_ROUNDING * part)
    return max((k for k in range(1, groups + 1) if fits(k)), default=1)


def with_overrides(cfg: ExperimentConfig, ratio: str | None = None, eta: int | None = None,
                   shrink: int | None = None) -> ExperimentConfig:
    out = copy.deepcopy(cfg)
    if ratio is not None:
        out.launcher.gen_train_ratio = ratio
    if eta is not None:
        out.controller.max_staleness = eta
    if shrink is not None:
        out.simulate.shrink = shrink
    return out


def build(cfg: ExperimentConfig, calibration=None) -> Scenario:
    """Plan + layout + costs + setup for one configuration (raises PlanError/ConfigError)."""
    sim, la = cfg.simulate, cfg.launcher
    eta = cfg.controller.max_staleness
    tp, pp = cfg.trainer.tensor_parallel, cfg.trainer.pipeline_parallel
    if cfg.gen.backend == "embedded":
        # CPU servers on one machine: no GPU plan and no datasheet; only a calibration knows
        # their speed (this is how the simulator is checked against the embedded runs).
        if calibration is None:
            raise ConfigError("gen.backend=embedded has no datasheet cost model: simulate it with "
                              "--calibrate EXP_DIR (a run's metrics), or set gen.backend=sglang to "
                              "simulate GPU servers")
        plan = None
        servers, train_gpus = cfg.gen.num_servers, calibration.train_world
    elif sim.colocated:
        if eta != 0:
            raise ConfigError(f"simulate.colocated=true needs controller.max_staleness=0 (synchronous), "
                              f"got {eta}")
        # Every GPU generates, then every GPU trains; the plan only checks the layouts fit.
        plan = make_plan(la.nodes, la.gpus_per_node, "1:1", gen_tp=cfg.gen.tp_size, train_tp=tp,
                         train_pp=pp)
        total = la.nodes * la.gpus_per_node
        if total % (tp * pp):
            raise PlanError(f"colocated: {total} GPUs not divisible by trainer TP x PP = {tp} x {pp}")
        servers, train_gpus = total // cfg.gen.tp_size, total
    else:
        plan = plan_for(cfg, place_cpus=False)
        servers, train_gpus = plan.num_servers, plan.train_gpus
    layout = Layout(gen_tp=cfg.gen.tp_size, num_servers=servers, train_gpus=train_gpus, train_tp=tp,
                    train_pp=pp, gpus_per_node=la.gpus_per_node,
                    ppo_minibatches=cfg.trainer.ppo_n_minibatches,
                    tokens_per_mb=cfg.trainer.max_tokens_per_mb, train_ep=cfg.trainer.expert_parallel)
    B, n = cfg.trainer.groups_per_step, cfg.rollout.n_samples
    max_new = cfg.rollout.max_new_tokens
    notes = []
    reward_s = sim.reward_s
    if calibration is not None:
        costs = calibration.costs(layout, max_running=cfg.gen.max_running_requests)
        notes.append(f"costs calibrated from {calibration.source}")
        if not reward_s and calibration.grade_s:
            reward_s = calibration.grade_s
            notes.append(f"grading takes {1e3 * reward_s:.0f} ms per group (the run's median; "
                         f"simulate.reward_s sets another)")
    else:
        gpu = load_gpu(sim.hardware)
        model = load_model_shape(sim.model_size, cfg.experiment.model)
        if gpu.gpus_per_node != la.gpus_per_node:
            notes.append(f"{gpu.name} nodes usually have {gpu.gpus_per_node} GPUs; the config says "
                         f"launcher.gpus_per_node={la.gpus_per_node}")
        hint = B * n * (sim.prompt_tokens + min(sim.output_median, max_new))
        costs = physical_costs(gpu, model, layout, mem_fraction=cfg.gen.mem_fraction_static,
                               max_running=cfg.gen.max_running_requests, weight_sync=cfg.trainer.weight_sync,
                               disk_gbps=sim.disk_gbps, colocated=sim.colocated, batch_tokens_hint=hint,
                               relay=cfg.gen.weight_relay)
        notes.append(f"{model.name} ({model.params / 1e9:.2f}B parameters) on {gpu.name}")
    notes += costs.notes
    # The embedded server keeps no prefix cache: each chunk is prefilled in full there.
    prefix_cached = sim.chunk_prefix_cached and cfg.gen.backend != "embedded"
    if sim.chunk_prefix_cached and not prefix_cached and getattr(cfg.rollout, "new_tokens_per_chunk", 0):
        notes.append("simulate.chunk_prefix_cached ignored: the embedded server has no prefix cache, so "
                     "every chunk is prefilled in full")
    warmup, total = step_counts(cfg)
    # Groups in flight: the controller's cap, or what the rollout workers can run, if fewer.
    in_flight = min(cfg.controller.max_concurrent_groups, cfg.rollout.num_workers * cfg.rollout.concurrency)
    k = shrink_factor(sim.shrink, servers, B, n)
    if k > 1:
        # The slice's trainer still takes as long as the whole batch would.
        costs = replace(costs, train_per_token=costs.train_per_token * k, train_per_sq=costs.train_per_sq * k)
        notes.append(f"simulated 1/{k} of the cluster ({round(servers / k)} servers, {B // k} groups per "
                     f"step); rates scaled back up (simulate.shrink=1 to simulate it all)")
    setup = SimSetup(num_servers=max(1, round(servers / k)), groups_per_step=B // k, n_samples=n, eta=eta,
                     max_concurrent_groups=max(1, in_flight // k), steps=total, warmup_steps=warmup,
                     prompt_tokens=sim.prompt_tokens, max_new_tokens=max_new,
                     interruptible=cfg.controller.interruptible,
                     resubmit_interrupted=resubmits_interrupted(cfg),
                     reprefill_interrupted=getattr(cfg.controller, "interrupt_mode", "abort") != "in_place",
                     reward_s=reward_s,
                     wait_for_ack=cfg.trainer.wait_for_ack, checkpoint_every=cfg.trainer.checkpoint_every,
                     coalesce_versions=coalesces_versions(cfg.controller.interruptible, cfg.trainer.weight_sync,
                                                          cfg.trainer.wait_for_ack),
                     keep_weights=cfg.trainer.keep_weights,
                     admit_delay_s=cfg.controller.retry_after_s / 2,
                     # read with getattr: configs from before the key existed have no chunks
                     chunk_tokens=getattr(cfg.rollout, "new_tokens_per_chunk", 0),
                     chunk_prefix_cached=prefix_cached)
    return Scenario(cfg=cfg, plan=plan, layout=layout, setup=setup, costs=costs, notes=notes, shrink=k)


def resubmits_interrupted(cfg: ExperimentConfig) -> bool:
    """Whether an interrupted request returns to its rollout worker to be sent again.

    `controller.interrupt_mode` (SGLang's pause modes): abort returns it; retract keeps it on
    the server, which re-prefills it under the new weights. Configs without the key abort."""
    return getattr(cfg.controller, "interrupt_mode", "abort") not in ("retract", "in_place")


def step_counts(cfg: ExperimentConfig, eta: int | None = None) -> tuple[int, int]:
    """(warm-up steps, total steps): the warm-up lasts at least eta + 1 steps."""
    eta = cfg.controller.max_staleness if eta is None else eta
    warmup = max(cfg.simulate.warmup_steps, eta + 1 if eta > 0 else 0)
    return warmup, warmup + cfg.simulate.steps


def lengths_for(cfg: ExperimentConfig, max_eta: int):
    sim = cfg.simulate
    _, total = step_counts(cfg, max_eta)
    count = cfg.trainer.groups_per_step * (total + max_eta + 1) * cfg.rollout.n_samples
    return sample_lengths(sim.output_lengths, count, median=sim.output_median, sigma=sim.output_sigma,
                          max_new_tokens=cfg.rollout.max_new_tokens, seed=sim.seed)


def simulate(cfg: ExperimentConfig, calibration=None, lengths=None,
             growth_span: tuple[float, float] = (0.0, 1.0)) -> tuple[Scenario, SimResult]:
    """One configuration; `growth_span` is the part of the run whose lengths it simulates
    (simulate.length_growth: (0, 1) the whole run, a phase of it for --elastic)."""
    sc = build(cfg, calibration)
    if lengths is None:
        lengths = lengths_for(cfg, cfg.controller.max_staleness)
    lengths = grow_lengths(lengths, cfg.simulate.length_growth, cfg.rollout.max_new_tokens,
                           samples_used(sc.setup), growth_span)
    r = Simulation(sc.setup, sc.costs, lengths).run()
    k = sc.shrink
    if k > 1:
        r = replace(r, trajectories_per_s=r.trajectories_per_s * k, gen_tokens_per_s=r.gen_tokens_per_s * k,
                    trained_tokens_per_s=r.trained_tokens_per_s * k, interrupts=r.interrupts * k,
                    retractions=r.retractions * k, chunk_resumes=r.chunk_resumes * k)
    return sc, r


@dataclass
class SweepCell:
    ratio: str
    eta: int
    result: SimResult | None = None
    error: str | None = None


@dataclass
class Sweep:
    ratios: list[str]
    etas: list[int]
    cells: dict[tuple[str, int], SweepCell]

    def best(self, eta: int | None = None) -> SweepCell | None:
        ok = [c for c in self.cells.values() if c.result and (eta is None or c.eta == eta)]
        return max(ok, key=lambda c: c.result.steps_per_hour, default=None)


def _sweep_point(args) -> SweepCell:
    cfg, r, e, calibration, lengths = args
    cell = SweepCell(r, e)
    try:
        _, cell.result = simulate(with_overrides(cfg, r, e), calibration, lengths)
    except (PlanError, SimulationError, ConfigError) as err:
        cell.error = str(err)
    return cell


def sweep(cfg: ExperimentConfig, ratios: list[str], etas: list[int], calibration=None,
          jobs: int = 1) -> Sweep:
    """Every (ratio, eta) on the same drawn workload; `jobs` > 1 runs points in processes."""
    lengths = lengths_for(cfg, max(etas))
    points = [(cfg, r, e, calibration, lengths) for r in ratios for e in etas]
    if jobs > 1 and len(points) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(jobs, len(points)), mp_context=mp.get_context("fork")) as ex:
            done = list(ex.map(_sweep_point, points))
    else:
        done = [_sweep_point(p) for p in points]
    return Sweep(ratios, etas, {(c.ratio, c.eta): c for c in done})
