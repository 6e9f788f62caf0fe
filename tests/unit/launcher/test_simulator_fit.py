"""`tandem simulate --calibrate` on a real 10-step run (tests/support/recorded_run.py): it
simulates the run's own workload, prints how well the fit predicts the run it came from, and
refuses a fit more than 15% off unless told to accept it."""
from __future__ import annotations

import json
import re

import pytest
from recorded_run import CONFIG, REPO, write_recorded_run

from tandem.launcher.cli import main
from tandem.launcher.config import load_experiment
from tandem.launcher.progress import run_steps
from tandem.launcher.simulate.calibrate import calibrate
from tandem.launcher.simulate.fit_check import check_fit
from tandem.launcher.simulate.scenario import simulate
from tandem.services.protocol import ExpDir, read_metrics


@pytest.fixture
def run(tmp_path) -> ExpDir:
    return write_recorded_run(ExpDir(tmp_path / "run"))


def measured_s(exp: ExpDir, first: int = 3) -> float:
    steps = run_steps(read_metrics(exp, "trainer"))
    return (steps[-1]["time"] - steps[first]["time"]) / (len(steps) - first - 1)


def test_the_calibration_knows_the_runs_workload(run):
    cal = calibrate(run.root)
    groups = [r for r in read_metrics(run, "rollout") if r.get("event") == "group"]
    assert cal.prompt_tokens == round(sum(g["prompt_tokens"] for g in groups) / len(groups)) == 12
    assert cal.output_lengths == f"empirical:{run.root}"


def test_the_fit_predicts_its_own_run_and_the_default_workload_did_not(run):
    cal = calibrate(run.root)
    fit = check_fit(cal, run.root)
    assert fit.measured_s == pytest.approx(measured_s(run)) and fit.steps == (5, 10)
    assert abs(fit.error) < 0.15, fit.text()
    # The cause of the 6x: the `simulate` defaults' workload (512-token prompts, answers at
    # the 96-token limit) priced with this run's costs, instead of the run's 12-token prompts.
    cfg = load_experiment(run.root)
    cfg.simulate.warmup_steps, cfg.simulate.steps = 3, 6
    _, r = simulate(cfg, cal)
    assert r.step_s > 3 * measured_s(run)


def test_simulate_prints_the_fit_and_predicts_the_run(run, capsys):
    assert main(["simulate", str(REPO / CONFIG), "--calibrate", str(run.root)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("fit on its own run"))
    assert re.search(r"predicted [\d.]+ s a step, measured [\d.]+ s \(steps 5-10\): error [+-][\d.]+%", line)
    assert "workload of the calibration run" in out and "prompts of 12 tokens" in out
    predicted = float(re.search(r"seconds / step\s*│\s*([\d.]+)", out).group(1))
    assert predicted == pytest.approx(measured_s(run), rel=0.15)


def _slow_trainer(exp: ExpDir, factor: float) -> None:
    """The same records with the trainer's steps spread `factor` times further apart: costs
    fitted from the windows no longer explain the run's pace."""
    recs = [json.loads(x) for x in exp.metrics.read_text().splitlines()]
    t0 = min(r["time"] for r in recs if r.get("event") == "step")
    for r in recs:
        if r.get("event") == "step":
            r["time"] = t0 + factor * (r["time"] - t0)
    exp.metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_fit_that_misses_its_own_run_is_refused_in_one_line(run, capsys):
    _slow_trainer(run, 4.0)
    assert main(["simulate", str(REPO / CONFIG), "--calibrate", str(run.root)]) == 2
    captured = capsys.readouterr()
    assert "Simulated" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "misses its own run by -7" in err[0] and "--accept-poor-fit" in err[0]
    assert main(["simulate", str(REPO / CONFIG), "--calibrate", str(run.root), "--accept-poor-fit"]) == 0
    out = capsys.readouterr().out
    assert "warning: simulating with a calibration -7" in out and "Simulated" in out


def test_a_workload_the_user_set_is_kept(run, capsys):
    assert main(["simulate", str(REPO / CONFIG), "simulate.output_lengths=fixed", "simulate.output_median=50",
                 "--calibrate", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "workload as configured: simulate.output_lengths, simulate.output_median" in out
    assert "prompts of 12 tokens" in out and "output lengths empirical" not in out


def test_a_run_without_its_config_is_not_checked_and_says_why(run):
    run.config.unlink()
    fit = check_fit(calibrate(run.root), run.root)
    assert fit.error is None and not fit.poor()
    assert fit.text().startswith("fit not checked on its own run: its config cannot be read")
