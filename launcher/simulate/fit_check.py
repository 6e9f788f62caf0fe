"""Is a calibration any good? Predict the run it was fitted on, and simulate its workload.

`tandem simulate --calibrate RUN` once predicted 26.9 s a step for a configuration whose
10-step run measured about 4 s, and said nothing. Two causes, both fixed here:

- The workload. The fit is right for the run's requests, but the simulation drew its own: the
  `simulate` defaults describe a reasoning model (512-token prompts, lognormal answers of median
  4,096 tokens, here clipped at `rollout.max_new_tokens`), while the tiny run's prompts were ~20
  tokens and its answers shorter than the limit. Priced per padded KV entry and per trained
  token, that is several times the work. `adopt_run_workload` therefore simulates the run's own
  prompt length and output lengths (`empirical:RUN`) unless the user set
  `simulate.prompt_tokens` / `simulate.output_lengths` (in the file or as overrides), and says so.
- No check. `check_fit` simulates the calibration run's own config (its `config.yaml`, its
  workload, its warm-up skipped) with the fitted costs and compares the seconds per step with
  what the run measured between its trainer step records; the CLI prints the error and refuses
  the calibration when it is worse than `FIT_TOLERANCE`, unless told to accept it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.launcher.config import ConfigError, ExperimentConfig, load_experiment
from tandem.launcher.progress import run_steps
from tandem.launcher.simulate.calibrate import Calibration, read_records

FIT_TOLERANCE = 0.15
WORKLOAD_KEYS = ("prompt_tokens", "output_lengths", "output_median", "output_sigma")


@dataclass
class FitCheck:
    """Predicted vs measured seconds per step on the calibration's own run (None: not checked,
    `why` says why)."""
    predicted_s: float | None = None
    measured_s: float | None = None
    steps: tuple[int, int] | None = None   # the measured steps, first and last
    why: str | None = None

    @property
    def error(self) -> float | None:
        if self.predicted_s is None or not self.measured_s:
            return None
        return self.predicted_s / self.measured_s - 1

    def poor(self, tolerance: float = FIT_TOLERANCE) -> bool:
        return self.error is not None and abs(self.error) > tolerance

    def text(self) -> str:
        if self.error is None:
            return f"fit not checked on its own run: {self.why}"
        return (f"fit on its own run: predicted {self.predicted_s:.3g} s a step, measured {self.measured_s:.3g} s "
                f"(steps {self.steps[0]}-{self.steps[1]}): error {100 * self.error:+.1f}% "
                f"(limit {100 * FIT_TOLERANCE:.0f}%)")


def explicit_simulate_keys(file: str | Path | None, overrides: list[str]) -> set[str]:
    """The `simulate` keys the user set: in the experiment file's `simulate` section or as
    `simulate.KEY=...` overrides."""
    keys = {ov.split("=", 1)[0].removeprefix("simulate.") for ov in overrides if ov.startswith("simulate.")}
    if file is not None:
        try:
            raw = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError):
            raw = {}
        section = raw.get("simulate") if isinstance(raw, dict) else None
        keys |= set(section) if isinstance(section, dict) else set()
    return keys


def adopt_run_workload(cfg: ExperimentConfig, cal: Calibration, explicit: set[str]) -> list[str]:
    """Simulate the calibration run's prompt length and output lengths, each unless the user set
    it (`simulate.prompt_tokens`; `simulate.output_lengths` / `output_median` / `output_sigma`);
    returns a note of what was adopted and what was kept."""
    adopted, kept = [], sorted(explicit & set(WORKLOAD_KEYS))
    if cal.prompt_tokens and "prompt_tokens" not in explicit:
        cfg.simulate.prompt_tokens = cal.prompt_tokens
        adopted.append(f"prompts of {cal.prompt_tokens} tokens")
    if cal.output_lengths and not explicit & set(WORKLOAD_KEYS[1:]):
        cfg.simulate.output_lengths = cal.output_lengths
        adopted.append(f"output lengths {cal.output_lengths}")
    notes = []
    if adopted:
        notes.append(f"workload of the calibration run {cal.source}: {'; '.join(adopted)} (set "
                     f"simulate.prompt_tokens / simulate.output_lengths to simulate another)")
    if kept:
        notes.append(f"workload as configured: simulate.{', simulate.'.join(kept)}")
    return notes


def check_fit(cal: Calibration, exp_dir: str | Path) -> FitCheck:
    """Simulate the calibration run with its own fitted costs; compare seconds per step after
    its warm-up (max(simulate.warmup_steps, eta + 1) steps, as the simulator measures)."""
    from tandem.launcher.simulate.engine import SimulationError
    from tandem.launcher.simulate.scenario import simulate

    path = Path(exp_dir)
    try:
        cfg = copy.deepcopy(load_experiment(path))
    except ConfigError as e:
        return FitCheck(why=f"its config cannot be read ({e})")
    steps = run_steps([r for r in read_records(path) if r.get("role") == "trainer"])
    eta = cfg.controller.max_staleness
    warm = min(max(cfg.simulate.warmup_steps, eta + 1 if eta > 0 else 0), len(steps) - 2)
    if warm < 0 or len(steps) < 3:
        return FitCheck(why=f"{len(steps)} training steps recorded; at least 3 are needed")
    measured = (steps[-1]["time"] - steps[warm]["time"]) / (len(steps) - warm - 1)
    adopt_run_workload(cfg, cal, set())
    cfg.simulate.warmup_steps, cfg.simulate.steps = warm, len(steps) - warm - 1
    try:
        _, r = simulate(cfg, cal)
    except (ConfigError, SimulationError) as e:
        return FitCheck(measured_s=measured, why=f"the run cannot be simulated ({e})")
    return FitCheck(predicted_s=r.step_s, measured_s=measured,
                    steps=(steps[warm + 1].get("step", warm + 2), steps[-1].get("step", len(steps))))
