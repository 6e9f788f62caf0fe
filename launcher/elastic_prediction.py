"""Where the elastic split should go: predicted speeds of the current split and its neighbours.

Output lengths grow during RL training, so the split that was best at the start stops being
best. At each decision point (launcher/elastic.py) this module:
  1. calibrates the cost model on the run's metrics since the split last changed
     (`launcher.simulate.calibrate`, on `<exp>/elastic/window.jsonl`): one split's windows, so the
     trainer's step cost was measured on one CPU count, and the run's recent prompt and output
     lengths are the workload simulated;
  2. simulates the current split and its neighbours (`launcher.simulate.scenario.simulate`): one
     server fewer with the trainer holding that server's CPUs too, one server more with the
     trainer that many CPUs fewer. ASSUMPTION: the trainer's compute time scales inversely with
     its CPUs (the fit's t0 and t1 times measured/candidate CPUs), as a CPU trainer's matrix
     products split evenly over its threads; a server's cost does not change, since every
     server keeps its own CPU set;
  3. asks the decision rule (`launcher.elastic_policy.choose_split`, shared with the simulator's
     prediction of the gain before a run) for the neighbour to move to, or none.
The speed compared is steps per hour.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Protocol

from tandem.services.protocol import ExpDir

from .config import ConfigError, ExperimentConfig
from .elastic_moves import possible_moves
from .placement import CpuPlacement

log = logging.getLogger(__name__)


class SplitState(Protocol):
    """What a prediction reads of the run's split (launcher/elastic.py's ElasticSplit has it)."""
    cfg: ExperimentConfig
    exp: ExpDir
    since: float                        # when the current split began (its windows start there)
    servers: list                       # the generation servers of the current split
    trainer_cpus: tuple[int, ...]
    placement: CpuPlacement
    retired: list[tuple[int, ...]]      # CPU sets of retired servers, the last on top


@dataclass
class Decision:
    """What the launcher decided at one decision point."""
    target: int | None                  # servers of the split to move to; None: stay
    speeds: dict[int, float | None] = field(default_factory=dict)   # servers -> predicted steps/h
    why: str = ""


def split_steps_per_hour(cfg: ExperimentConfig, cal, servers: int, cpu_ratio: float, lengths=None,
                         span: tuple[float, float] = (0.0, 1.0)) -> float:
    """Predicted steps/h of `cfg` with `servers` generation servers, from calibration `cal` made
    on another split: the fit's trainer cost (t0, t1) times `cpu_ratio` (= the trainer's CPUs
    when calibrated / its CPUs in this split: the module docstring's ASSUMPTION), a server's cost
    unchanged. `lengths` and `span` as `scenario.simulate` takes them (a phase of a growing
    workload). Raises what the simulator raises."""
    from tandem.launcher.simulate.scenario import simulate

    c = copy.deepcopy(cfg)
    c.gen.num_servers = servers
    scaled = replace(cal, t0=cal.t0 * cpu_ratio, t1=cal.t1 * cpu_ratio)
    return simulate(c, scaled, lengths, growth_span=span)[1].steps_per_hour


def simulated_decision(split: SplitState) -> Decision:
    """Calibrate on the current split's windows, simulate it and its neighbours, ask the rule."""
    from tandem.launcher.elastic_policy import choose_split
    from tandem.launcher.simulate.calibrate import calibrate, read_records
    from tandem.launcher.simulate.fit_check import adopt_run_workload

    window = split.exp.root / "elastic" / "window.jsonl"
    window.parent.mkdir(exist_ok=True)
    recs = [r for r in read_records(split.exp.root)
            if r.get("time", 0) >= split.since or r.get("event") == "cpu_placement"]
    window.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cal = calibrate(window)
    here, measured = len(split.servers), len(split.trainer_cpus)
    # servers -> the trainer's CPUs, for this split and each move that fits (elastic_moves.py)
    candidates = {here: measured, **{len(p.servers): len(p.train)
                                    for p in possible_moves(split.placement, split.retired).values()}}
    cfg = copy.deepcopy(split.cfg)
    adopt_run_workload(cfg, cal, set())   # the window's prompts and lengths, the same for every split
    speeds: dict[int, float | None] = {}
    for servers, cpus in sorted(candidates.items()):
        try:
            speeds[servers] = split_steps_per_hour(cfg, cal, servers, measured / cpus)
        except ConfigError as e:
            log.warning("elastic split: cannot simulate %d server(s): %s", servers, e)
            speeds[servers] = None
    order = sorted(speeds)
    target = choose_split(order, here, speeds, split.cfg.launcher.elastic_min_gain)
    best = max((s for s in order if speeds[s]), key=lambda s: speeds[s], default=here)
    measured_on = ", ".join(f"{n} {what}" for what, n in cal.samples.items())
    why = (f"calibrated on {measured_on}; {best} server(s) predicted fastest" +
           ("" if target is not None else f", not more than {split.cfg.launcher.elastic_min_gain:.0%} "
                                          f"faster than {here} (or not a neighbour that gains)"))
    return Decision(target, speeds, why)
