"""The elastic split against the best fixed split, on a workload whose lengths grow (issue 38).

Issue 38's test in the miniature: a long-tail workload whose lengths grow during the run
finishes >= 15% faster with `launcher.elastic: true` than with the best fixed split chosen at
the start, one run each, same seed, and the audit shows nothing lost or trained twice.

The workload is benchmarks/growing_lengths.py: lognormal lengths (long tail) whose median grows
12-fold (12 to 144 tokens) with the policy version a group is admitted at, over the run's
`trainer.total_steps`, so the balance of the pools moves during the run (growing_lengths.py
says why): the split fastest at the start is not the fastest at the end.

A "split" in the miniature is how many generation servers run, one CPU each, against the
trainer's CPUs (launcher/placement.py's disjoint pools, set explicitly through `launcher.cpus.*`):
the first CPUs go to the light services (an eighth of the machine; none below 4 CPUs, where they
share the servers' CPUs), the next `k` to `k` servers, the rest to the trainer. An elastic move
hands one server's CPU to the trainer or back (launcher/elastic_moves.py).

Steps, as a user would take them:
1. calibration: a short run at the start's lengths (`growing_lengths:start_episode`, no growth)
   on the middle split, and the simulator calibrated on it (`launcher.simulate.calibrate`)
   predicts every split at those lengths; the fastest is "the best fixed split chosen at the
   start". The prediction moves the trainer's cost inversely with its CPUs and keeps a server's
   (the runtime's own assumption, launcher/elastic_prediction.py);
2. a run with that split fixed, and 3. a run with `launcher.elastic: true` from the same split
   (decisions every `launcher.elastic_every_steps` steps, moves when predicted > 15% faster);
   same config, same seed, same lengths per prompt and version.
Reported: wall time and seconds per step of each, the gain of elastic over fixed, every
`elastic_decision` and `elastic_move` record, the audit of each run (launcher/audit.py), and the
simulator's prediction of the gain before the runs (launcher/simulate/elastic.py's `replay`: the
runtime's rule on per-phase speed tables, here priced for CPU splits from the calibration).

Needs a machine where an elastic move fits (at least 3 CPUs, meant for 16): on fewer `main`
stops at once with the preflight's own reason (launcher/elastic_moves.py: `elastic_problems`),
exits non-zero and writes nothing. `--quick` checks the mechanics (an untrained model, a few
short steps, a decision every 2 steps) on the same kind of machine and writes nothing.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import growing_lengths
from benchmarks.async_vs_sync import kept_on_failure, tandem
from benchmarks.common import cli, print_table, write_results
from tandem.launcher.config import ConfigError, load_config
from tandem.launcher.placement import available_cpus, format_ranges
from tandem.services.protocol import ExpDir, read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/math-tiny.yaml"
SEED = 1
WARMUP = 5                 # steps left out of seconds per step (the pipeline fills, first passes)
STEPS = growing_lengths.OVER_VERSIONS
CALIBRATION_STEPS = 20
WORKLOAD = ["controller.max_staleness=4", "rollout.max_new_tokens=448", "rollout.eval_size=0",
            "rollout.eval_every=0", f"experiment.seed={SEED}"]
# The quick path checks the mechanics only: small steps of an untrained model, short answers, a
# decision every 2 steps so that one is made.
QUICK = ["trainer.groups_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=96",
         "trainer.checkpoint_every=0", "launcher.elastic_every_steps=2"]
QUICK_STEPS, QUICK_CALIBRATION_STEPS = growing_lengths.QUICK_VERSIONS, 3


class NotEnoughCpus(RuntimeError):
    """No elastic move fits this machine: the benchmark cannot measure anything here."""


@dataclass(frozen=True)
class Layout:
    """The machine's CPUs as the benchmark splits them: the light services' own, then a pool that
    `k` generation servers (one CPU each, from its start) and the trainer (the rest) share."""
    services: tuple[int, ...]
    pool: tuple[int, ...]

    @property
    def candidates(self) -> list[int]:
        """Server counts that leave the trainer at least one CPU."""
        return list(range(1, len(self.pool)))

    @property
    def middle(self) -> int:
        """The calibration's split: as many servers as the trainer has CPUs (or one fewer)."""
        return max(1, len(self.pool) // 2)

    def trainer_cpus(self, servers: int) -> int:
        return len(self.pool) - servers

    def overrides(self, servers: int) -> list[str]:
        out = [f"gen.num_servers={servers}", f"launcher.cpus.gen={format_ranges(self.pool[:servers])}",
               f"launcher.cpus.train={format_ranges(self.pool[servers:])}"]
        return out + ([f"launcher.cpus.services={format_ranges(self.services)}"] if self.services else [])

    def label(self, servers: int) -> str:
        return f"{servers} server(s) + trainer on {self.trainer_cpus(servers)} CPU(s)"


def layout_for(cpus) -> Layout:
    """An eighth of the machine (at least one CPU) for the light services from 4 CPUs up; below,
    they share the servers' CPUs, as the 2-CPU default placement does."""
    cpus = tuple(sorted(cpus))
    services = max(1, round(len(cpus) / 8)) if len(cpus) >= 4 else 0
    return Layout(services=cpus[:services], pool=cpus[services:])


def base_overrides(quick: bool) -> list[str]:
    return [*WORKLOAD, *(QUICK if quick else [])]


def elastic_refusal(cpus) -> str | None:
    """Why an elastic run cannot start on `cpus` at the calibration's split, in the preflight's
    own words (launcher/preflight.py runs the same `elastic_problems` on the same placement);
    None when a move fits."""
    from tandem.launcher.elastic_moves import elastic_problems
    from tandem.launcher.plan import cpu_placement_for

    layout = layout_for(cpus)
    try:
        cfg = load_config(CONFIG, [*base_overrides(False), *layout.overrides(layout.middle), "launcher.elastic=true"])
        placement = cpu_placement_for(cfg, available=tuple(sorted(cpus)))
    except ConfigError as e:
        return str(e)
    problems = elastic_problems(cfg, placement)
    return "; ".join(f"{key}: {message}" for key, message in problems) or None


def require_a_move_fits(cpus) -> None:
    """NotEnoughCpus, naming the CPUs this machine has and the fewest that would do, unless an
    elastic move fits `cpus`."""
    problem = elastic_refusal(cpus)
    if problem is None:
        return
    needed = next((n for n in range(len(cpus) + 1, 65) if elastic_refusal(range(n)) is None), None)
    need = f"at least {needed} CPUs" if needed else "more CPUs"
    raise NotEnoughCpus(f"no elastic move fits this machine's {len(cpus)} CPU(s) ({format_ranges(cpus)}); "
                        f"the benchmark needs {need} (preflight: {problem})")


# ---- the runs -------------------------------------------------------------------------------
def run(name: str, work: Path, model: Path, steps: int, overrides: list[str]) -> Path:
    exp = work / name
    tandem("run", str(CONFIG), f"experiment.model={model}", f"experiment.exp_dir={exp}",
           f"trainer.total_steps={steps}", *overrides, timeout=3600)
    return exp


def measure(exp: Path, groups_per_step: int) -> dict:
    """Wall time, seconds per step after the warm-up, the lengths at both ends, the elastic records
    and the audit of one finished run."""
    from tandem.launcher.audit import audit

    e = ExpDir(exp)
    summary = json.loads((exp / "summary.json").read_text())
    steps = read_metrics(e, "trainer", "step")
    warm = max(0, min(WARMUP, len(steps) - 2))
    span = steps[-1]["time"] - steps[warm]["time"]
    groups = sorted((r for r in read_metrics(e, "rollout") if r.get("event") == "group"), key=lambda r: r["time"])
    tenth = max(1, len(groups) // 10)
    a = audit(e)
    clean = (not a.lost and not a.trained_twice and not a.prompts_trained_twice
             and a.trained == a.steps * groups_per_step)
    moves = read_metrics(e, "launcher", "elastic_move")
    return {"wall_s": summary["wall_s"], "steps": len(steps), "s_per_step": span / max(1, len(steps) - warm - 1),
            "first_step_to_last_s": steps[-1]["time"] - steps[0]["time"],
            "mean_output_tokens_first_tenth": mean_tokens(groups[:tenth]),
            "mean_output_tokens_last_tenth": mean_tokens(groups[-tenth:]),
            "audit": a.as_dict(), "audit_clean": clean,
            "decisions": read_metrics(e, "launcher", "elastic_decision"), "moves": moves,
            "moves_made": sum(1 for m in moves if m.get("ok")),
            "servers_at_end": moves[-1]["servers"] if moves else None}   # every move record has the count after it


def mean_tokens(groups: list[dict]) -> float:
    """Mean output tokens per sample of these group records."""
    return sum(sum(g["output_tokens"]) for g in groups) / max(1, sum(len(g["output_tokens"]) for g in groups))


# ---- the simulator's side -------------------------------------------------------------------
def split_speed(cfg, cal, layout: Layout, servers: int, calibrated_on: int, lengths=None,
                span: tuple[float, float] = (0.0, 1.0)) -> float | None:
    """Predicted steps/h of `servers` servers, from a calibration made at `calibrated_on` servers
    (launcher/elastic_prediction.py's split_steps_per_hour, the runtime's own prediction)."""
    from tandem.launcher.elastic_prediction import split_steps_per_hour
    from tandem.launcher.simulate.engine import SimulationError

    ratio = layout.trainer_cpus(calibrated_on) / layout.trainer_cpus(servers)
    try:
        return split_steps_per_hour(cfg, cal, servers, ratio, lengths, span)
    except (ConfigError, SimulationError):
        return None


def simulated_config(cal, layout: Layout, calibrated_on: int, quick: bool, growth: float):
    from tandem.launcher.simulate.fit_check import adopt_run_workload

    cfg = load_config(CONFIG, [*base_overrides(quick), *layout.overrides(calibrated_on),
                               f"simulate.length_growth={growth}", f"simulate.warmup_steps={WARMUP}"])
    adopt_run_workload(cfg, cal, set())   # the calibration run's prompts and (start) lengths
    return cfg


def best_at_start(cal, layout: Layout, calibrated_on: int, quick: bool) -> tuple[int, dict[int, float | None]]:
    """The split a user would pick before the run: fastest at the calibration run's lengths."""
    cfg = simulated_config(cal, layout, calibrated_on, quick, 1.0)
    speeds = {k: split_speed(cfg, cal, layout, k, calibrated_on) for k in layout.candidates}
    known = {k: v for k, v in speeds.items() if v}
    if not known:
        raise RuntimeError(f"the simulator could not predict any split from the calibration ({cal.source})")
    return max(known, key=known.get), speeds


def predicted_gain(cal, layout: Layout, calibrated_on: int, quick: bool, steps: int):
    """launcher/simulate/elastic.py's prediction for CPU splits: each phase of the run simulated
    on every split with the lengths grown as the workload grows them (simulate.length_growth),
    then the fixed and elastic runs priced by `replay` (the runtime's decision rule)."""
    from tandem.launcher.simulate.elastic import Split, move_seconds, phase_count, replay
    from tandem.launcher.simulate.scenario import lengths_for

    cfg = simulated_config(cal, layout, calibrated_on, quick, growing_lengths.GROWTH)
    every, min_gain = cfg.launcher.elastic_every_steps, cfg.launcher.elastic_min_gain
    phases = phase_count(steps, every)
    lengths = lengths_for(cfg, cfg.controller.max_staleness)
    table = [{str(k): split_speed(cfg, cal, layout, k, calibrated_on, lengths, (p / phases, (p + 1) / phases))
              for k in layout.candidates} for p in range(phases)]
    splits = [Split(str(k), k, layout.trainer_cpus(k)) for k in layout.candidates]
    return replay(splits, table, steps, every, min_gain, move_seconds(cfg, cal), growing_lengths.GROWTH)


# ---- the benchmark --------------------------------------------------------------------------
def main(quick: bool = False) -> dict:
    cpus = available_cpus()
    require_a_move_fits(cpus)   # before anything is started or written
    from tandem.launcher.simulate.calibrate import calibrate

    layout = layout_for(cpus)
    steps, cal_steps = (QUICK_STEPS, QUICK_CALIBRATION_STEPS) if quick else (STEPS, CALIBRATION_STEPS)
    episode = "quick_episode" if quick else "episode"
    workload = [*base_overrides(quick), f"rollout.workflow=benchmarks.growing_lengths:{episode}"]
    groups_per_step = load_config(CONFIG, workload).trainer.groups_per_step
    with kept_on_failure("tandem-bench-elastic-") as tmp:
        work = Path(tmp)
        if quick:
            model = work / "tiny"
            tandem("model", "init-tiny", str(model), timeout=300)
        else:
            model = ROOT / ".cache" / "tiny-math-sft"
            tandem("sft", "--task", "math", "--out", str(model), timeout=3600)
        calibration = run("calibration", work, model, cal_steps,
                          [*base_overrides(quick), "rollout.workflow=benchmarks.growing_lengths:start_episode",
                           *layout.overrides(layout.middle)])
        cal = calibrate(calibration)
        start, start_speeds = best_at_start(cal, layout, layout.middle, quick)
        prediction = predicted_gain(cal, layout, layout.middle, quick, steps)
        print(f"best fixed split at the start (simulated on the calibration run): {layout.label(start)}", flush=True)
        fixed = measure(run("fixed", work, model, steps, [*workload, *layout.overrides(start)]), groups_per_step)
        elastic = measure(run("elastic", work, model, steps, [*workload, *layout.overrides(start),
                                                                "launcher.elastic=true"]), groups_per_step)
    return report(quick, cpus, layout, cal, start, start_speeds, prediction, fixed, elastic, steps)


def report(quick, cpus, layout: Layout, cal, start: int, start_speeds: dict, prediction, fixed: dict,
           elastic: dict, steps: int) -> dict:
    services = format_ranges(layout.services) if layout.services else "the servers' CPUs"
    print_table(f"splits at the start's lengths (calibrated on {layout.label(layout.middle)}, {len(cpus)} CPUs, "
                f"services on {services})",
                ["servers", "trainer CPUs", "predicted steps/h", "chosen"],
                [[k, layout.trainer_cpus(k), v, "<-" if k == start else ""] for k, v in start_speeds.items()])
    runs = {"fixed": fixed, "elastic": elastic}
    print_table(f"{steps} steps from {layout.label(start)}, same seed (s/step after the first "
                f"{max(0, min(WARMUP, steps - 2))} steps)",
                ["run", "wall s", "s/step", "first to last step s", "mean tokens, first tenth",
                 "mean tokens, last tenth", "moves", "audit clean"],
                [[name, r["wall_s"], r["s_per_step"], r["first_step_to_last_s"], r["mean_output_tokens_first_tenth"],
                  r["mean_output_tokens_last_tenth"], r["moves_made"], r["audit_clean"]] for name, r in runs.items()])
    print_table("elastic run: decisions", ["step", "servers", "trainer CPUs", "predicted steps/h", "target", "why"],
                [[d.get("step"), d.get("servers"), d.get("trainer_cpus"), json.dumps(d.get("speeds_steps_per_h")),
                  d.get("target"), d.get("why")] for d in elastic["decisions"]])
    print_table("elastic run: moves", ["step", "direction", "ok", "servers after", "trainer CPUs", "s", "detail"],
                [[m.get("step"), m.get("direction"), m.get("ok"), m.get("servers"), m.get("trainer_cpus"),
                  m.get("seconds"), m.get("detail")] for m in elastic["moves"]])
    print_table("audits (launcher/audit.py)", ["run", *fixed["audit"]],
                [[name, *r["audit"].values()] for name, r in runs.items()])
    gain = fixed["wall_s"] / elastic["wall_s"] - 1
    gain_steps = fixed["first_step_to_last_s"] / elastic["first_step_to_last_s"] - 1
    sim_gain = prediction.gain_over("start")
    print_table("elastic over fixed: measured vs the simulator's prediction before the runs",
                ["", "measured", "simulated"],
                [["gain (wall time)", gain, sim_gain], ["gain (first to last step)", gain_steps, None],
                 ["moves", elastic["moves_made"], len(prediction.moves)],
                 ["start split", start, prediction.start.gen_gpus]])
    headline = {
        "steps": steps, "cpus": len(cpus), "services_cpus": format_ranges(layout.services) if layout.services else None,
        "calibrated_on_servers": layout.middle, "calibration": str(cal.source),
        "start_servers": start, "start_trainer_cpus": layout.trainer_cpus(start),
        "start_speeds_steps_per_h": {str(k): v for k, v in start_speeds.items()},
        "growth": growing_lengths.GROWTH, "start_median_tokens": growing_lengths.START_MEDIAN,
        "elastic_gain_wall": round(gain, 3), "elastic_gain_first_to_last_step": round(gain_steps, 3),
        "sim_elastic_gain": round(sim_gain, 3), "sim_moves": [list(m) for m in prediction.moves],
        "sim_start_servers": prediction.start.gen_gpus, "sim_move_s": round(prediction.move_s, 2),
        "audits_clean": fixed["audit_clean"] and elastic["audit_clean"],
        "meets_issue_38": gain >= 0.15 and fixed["audit_clean"] and elastic["audit_clean"],
        **{f"{name}_{k}": v for name, r in runs.items() for k, v in r.items() if k not in ("decisions",)},
        "elastic_decisions": elastic["decisions"],
    }
    print(f"elastic over the best fixed split at the start: {100 * gain:+.1f}% wall time "
          f"({elastic['moves_made']} move(s); simulated {100 * sim_gain:+.1f}%); audits "
          f"{'clean' if headline['audits_clean'] else 'NOT clean'}", flush=True)
    if not quick:
        write_results("elastic_split", headline)
    return headline


def entry() -> None:
    """The command line: a machine too small is one line on stderr and exit status 1."""
    try:
        cli(main)
    except NotEnoughCpus as e:
        sys.exit(f"benchmarks.elastic_split: {e}")


if __name__ == "__main__":
    entry()
