"""The simulator on the placed miniature: where each calibrated cost came from, whether the
calibration run's pools were disjoint, and the two ways an interrupted request comes back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import load_config
from tandem.launcher.simulate.calibrate import calibrate
from tandem.launcher.simulate.costs import Costs
from tandem.launcher.simulate.engine import SimSetup, Simulation
from tandem.launcher.simulate.scenario import build, resubmits_interrupted
from tandem.rollout.server import cohorts
from tandem.rollout.server.window import GenWindow

PLACEMENT = {"role": "launcher", "event": "cpu_placement", "source": "planned", "available": "0-1",
             "gen": "0", "train": "1", "services": "0", "servers": ["0"],
             "shared": ["light services share the generation pool"]}


def _windows(placement: dict | None) -> list[dict]:
    """Server windows, a trainer step and weight syncs from a known law (as the roles log them)."""
    recs = []
    for n, ctx, steps, calls, tokens, reqs in [(8, 400, 100, 10, 300, 40), (32, 2000, 80, 30, 2400, 90),
                                               (64, 3000, 50, 5, 900, 20), (100, 9000, 60, 40, 1200, 300)]:
        recs.append({"role": "gen", "event": "gen_window", "gen_decode_s": steps * (0.004 + 0.0002 * n + 1e-6 * ctx),
                     "gen_steps": steps, "gen_running": n, "gen_context_tokens": ctx,
                     "gen_prefill_s": calls * 0.003 + 5e-5 * tokens, "gen_prefills": calls,
                     "gen_prefill_tokens": tokens, "gen_requests": reqs, "gen_overhead_s": 0.001 * reqs})
    recs += [{"role": "trainer", "train_tokens": t, "train_step_s": 0.5 + 1e-4 * t, "weight_publish_s": 0.05}
             for t in (4000, 6000, 5000)]
    recs.append({"role": "gen", "event": "gen_pause", "gen_paused_s": 0.02})
    if placement:
        recs.append(placement)
    return recs


def _write(path, recs) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_calibration_says_which_run_and_metrics_every_cost_came_from(tmp_path):
    run = tmp_path / "eta0"
    _write(run, _windows(PLACEMENT))
    cal = calibrate(run)
    src = cal.provenance
    assert src["decode step (d0, d1, d2)"] == f"{run}: gen_decode_s/gen_steps/gen_running/gen_context_tokens (4 records)"
    assert src["trainer step (t0, t1)"] == f"{run}: train_tokens/train_step_s (3 records)"
    assert src["request handling"].startswith(f"{run}: gen_overhead_s")
    assert src["server pause per update"].startswith(f"{run}: gen_paused_s")
    # Not measured in this run: said so, not invented.
    assert src["checkpoint"] == "default: free"
    assert cal.placement["gen"] == "0" and cal.placement["train"] == "1"
    assert any(n.startswith("measured on disjoint pools (generation on CPUs 0, training on 1") for n in cal.notes)


def test_calibration_warns_when_the_run_shared_cores_or_logged_no_placement(tmp_path):
    _write(tmp_path / "none", _windows(None))
    assert any("logged no CPU placement" in n for n in calibrate(tmp_path / "none").notes)
    shared = dict(PLACEMENT, gen="0-1", train="0-1", shared=["generation and training share CPUs"])
    _write(tmp_path / "shared", _windows(shared))
    assert any("do not carry over" in n and "shared CPUs" in n for n in calibrate(tmp_path / "shared").notes)


def test_simulate_prints_the_provenance_table(tmp_path, capsys):
    run = tmp_path / "eta0"
    _write(run, _windows(PLACEMENT))
    assert main(["simulate", "configs/math-tiny.yaml", "simulate.steps=2", "simulate.warmup_steps=1",
                 "--calibrate", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"costs calibrated from {run}" in out
    assert f"  trainer step (t0, t1): {run}: train_tokens/train_step_s (3 records)" in out
    assert "measured on disjoint pools" in out


def _toy(**kw) -> Costs:
    args = dict(decode_fixed=[0.0] + [0.01] * 8, decode_per_ctx=0.0, kv_capacity=float("inf"), max_running=8,
                train_fixed=0.1, train_per_token=0.0, train_per_sq=0.0, prefill_per_token=0.0,
                prefill_per_sq=0.0, publish_s=0.05, load_s=0.02, request_s=0.5)
    args.update(kw)
    return Costs(**args)


def test_retracted_requests_skip_the_resubmission_but_still_re_prefill():
    # eta 1, one server, single-sample groups of 1000 tokens: every publish interrupts the
    # running request. Resubmitted, it pays request handling (0.5 s) again; kept on the server
    # (retract), only its re-prefill.
    def run(resubmit: bool, **costs):
        setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=1, eta=1, max_concurrent_groups=10,
                         steps=4, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000,
                         resubmit_interrupted=resubmit)
        return Simulation(setup, _toy(**costs), np.array([1000] * 20)).run()
    abort, retract = run(True), run(False)
    assert abort.interrupts == retract.interrupts > 0
    assert abort.step_times[-1] - retract.step_times[-1] >= 0.5 * abort.interrupts - 1e-9
    # With free request handling the two modes are the same; a re-prefill is still paid by both.
    assert run(True, request_s=0.0).step_times == pytest.approx(run(False, request_s=0.0).step_times)
    slow = run(False, request_s=0.0, prefill_per_request=0.3)
    assert slow.step_times[-1] - run(False, request_s=0.0).step_times[-1] >= 0.3 * slow.interrupts


def test_interrupt_mode_selects_the_simulated_path(tmp_path):
    run = tmp_path / "eta0"
    _write(run, _windows(PLACEMENT))
    cfg = load_config("configs/math-tiny.yaml", ["controller.max_staleness=4"])
    # the default in_place: nothing resubmitted, nothing re-prefilled
    setup = build(cfg, calibrate(run)).setup
    assert not resubmits_interrupted(cfg) and not setup.resubmit_interrupted and not setup.reprefill_interrupted
    cfg.controller.interrupt_mode = "retract"
    setup = build(cfg, calibrate(run)).setup
    assert not resubmits_interrupted(cfg) and not setup.resubmit_interrupted and setup.reprefill_interrupted
    cfg.controller.interrupt_mode = "abort"
    setup = build(cfg, calibrate(run)).setup
    assert resubmits_interrupted(cfg) and setup.resubmit_interrupted and setup.reprefill_interrupted


def test_trainer_without_a_slope_is_priced_per_token_not_twice(tmp_path):
    # Nearly equal batches with noisy times (an untrained model answering to max_new_tokens):
    # the non-negative fit keeps only an intercept. The step must still cost what it measured.
    recs = [r for r in _windows(PLACEMENT) if "train_tokens" not in r]
    recs += [{"role": "trainer", "train_tokens": t, "train_step_s": s}
             for t, s in [(11747, 2.21), (11845, 3.35), (11280, 2.07), (11380, 4.41), (11779, 2.62)]]
    _write(tmp_path, recs)
    cal = calibrate(tmp_path)
    assert cal.t0 == 0.0
    mean_tokens = np.mean([11747, 11845, 11280, 11380, 11779])
    assert cal.t0 + cal.t1 * mean_tokens == pytest.approx(np.mean([2.21, 3.35, 2.07, 4.41, 2.62]), rel=0.02)
    assert any("proportional to tokens" in n for n in cal.notes)


def _steps_of_a_wave(rows: int, longest: int) -> list[tuple[int, int, int]]:
    """(passes, rows, padded entries) of a wave's decode steps: rows leave as they finish, the
    survivors grow, so rows and context are not proportional step by step; some steps decode
    long rows apart (a second pass)."""
    return [(1 + (k % 3 == 0), max(1, rows - k // 8), max(1, rows - k // 8) * (10 + k)) for k in range(longest)]


def test_decode_is_fitted_per_step_from_the_windows_moments(tmp_path):
    # Window means of such waves are nearly collinear; the pooled per-step sums are not.
    recs = [r for r in _windows(PLACEMENT) if r.get("event") != "gen_window"]
    for rows, longest in [(32, 120), (24, 200), (32, 90)]:
        w = GenWindow(interval_s=5.0)
        for f, n, p in _steps_of_a_wave(rows, longest):
            w.decode_step(0.002 * f + 1e-4 * n + 2e-7 * p, running=n, context_tokens=p, padded_tokens=p, passes=f)
        recs.append({"role": "gen", **w.flush(w.start + 1.0)})
    _write(tmp_path, recs)
    cal = calibrate(tmp_path)
    assert (cal.d0, cal.d1, cal.d2) == (pytest.approx(0.002), pytest.approx(1e-4), pytest.approx(2e-7))
    assert cal.decode_padded
    assert cal.provenance["decode step (d0, d1, d2)"].startswith(f"{tmp_path}: gen_decode_moments")


def test_a_padded_batch_pays_for_its_longest_row():
    # One long request (1000 tokens) and many short ones on one server: held tokens grow with
    # the short ones, padded entries with every row x the long one, so steps cost more padded.
    setup = SimSetup(num_servers=1, groups_per_step=4, n_samples=4, eta=2, max_concurrent_groups=12,
                     steps=3, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000)
    lengths = np.array(([1000] + [20] * 15) * 40)
    costs = dict(decode_fixed=[0.0] + [1e-4] * 8, decode_per_ctx=1e-5, request_s=0.0)
    held = Simulation(setup, _toy(**costs), lengths).run()
    padded = Simulation(setup, _toy(**costs, decode_padded=True), lengths).run()
    assert padded.step_times[-1] > 1.5 * held.step_times[-1]


def test_long_rows_apart_spare_the_short_ones_their_padding(monkeypatch):
    # The same mix on a server running 32 requests: the embedded server decodes rows grown long
    # as a second rectangle (rollout/server/cohorts.py), for one more pass per step; the
    # simulator applies the same rule, so the padded cost falls between held and one rectangle.
    setup = SimSetup(num_servers=1, groups_per_step=4, n_samples=8, eta=2, max_concurrent_groups=12,
                     steps=3, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000)
    lengths = np.array(([1000] + [20] * 7) * 40)
    costs = dict(decode_fixed=[0.0] + [1e-4] * 32, max_running=32, decode_per_ctx=1e-5, request_s=0.0,
                 decode_padded=True, decode_pass_s=1e-4)
    held = Simulation(setup, _toy(**{**costs, "decode_padded": False}), lengths).run()
    apart = Simulation(setup, _toy(**costs), lengths).run()
    monkeypatch.setattr(cohorts, "APART_MIN_ROWS", 10**6)
    together = Simulation(setup, _toy(**costs), lengths).run()
    assert held.step_times[-1] < apart.step_times[-1] < together.step_times[-1]

