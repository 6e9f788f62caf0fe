"""The simulator on the placed miniature: where each calibrated cost came from, whether the
calibration run's pools were disjoint, and the two ways an interrupted request comes back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from launcher.cli import main
from launcher.config import load_config
from launcher.simulate.calibrate import calibrate
from launcher.simulate.costs import Costs
from launcher.simulate.engine import SimSetup, Simulation
from launcher.simulate.scenario import build, resubmits_interrupted

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


def test_joining_a_batch_costs_per_resident_kv_entry():
    # One group of 2 samples (10-token prompt): the first joins an empty batch (free), the
    # second copies the first's 10 KV entries: 10 x 1e-3 = 0.01 s more on the critical path.
    setup = SimSetup(num_servers=1, groups_per_step=1, n_samples=2, eta=0, max_concurrent_groups=10,
                     steps=2, warmup_steps=0, prompt_tokens=10, max_new_tokens=100)
    lengths = np.array([10, 20] * 10)
    free = Simulation(setup, _toy(request_s=0.0), lengths).run()
    paid = Simulation(setup, _toy(request_s=0.0, join_per_kv_token=1e-3), lengths).run()
    assert paid.step_times[1] - free.step_times[1] == pytest.approx(0.01)
    # After an update, a full batch rejoins one row at a time: n(n-1)/2 rows copied at the
    # longest width, so interruptions of big batches cost far more than a synchronous step's joins.
    setup = SimSetup(num_servers=1, groups_per_step=2, n_samples=4, eta=2, max_concurrent_groups=10,
                     steps=4, warmup_steps=0, prompt_tokens=10, max_new_tokens=1000, resubmit_interrupted=False)
    lengths = np.array([1000] * 200)
    free = Simulation(setup, _toy(request_s=0.0), lengths).run()
    paid = Simulation(setup, _toy(request_s=0.0, join_per_kv_token=1e-4), lengths).run()
    assert paid.interrupts == free.interrupts > 0
    assert paid.step_times[-1] > free.step_times[-1]


def test_join_costs_are_calibrated_from_the_servers_join_timings(tmp_path):
    recs = _windows(PLACEMENT)
    for r, (joins, kv) in zip([r for r in recs if r.get("event") == "gen_window"],
                              [(40, 2000), (90, 90000), (20, 60000), (300, 30000)], strict=True):
        r.update(gen_join_s=2e-4 * joins + 1e-7 * kv, gen_joins=joins, gen_join_kv_tokens=kv)
    _write(tmp_path, recs)
    cal = calibrate(tmp_path)
    assert cal.join_per_kv_token == pytest.approx(1e-7, rel=1e-6)
    # The fixed part of a join is paid once per admitted request, with its handling.
    assert cal.request_s == pytest.approx(0.001 + 2e-4, rel=1e-6)
    assert cal.provenance["joining the running batch (per resident KV entry)"].startswith(f"{tmp_path}: gen_join_s")
    assert _calibrate_without_joins(tmp_path).join_per_kv_token == 0.0


def _calibrate_without_joins(tmp_path):
    _write(tmp_path / "old", _windows(PLACEMENT))
    cal = calibrate(tmp_path / "old")
    assert cal.provenance["joining the running batch (per resident KV entry)"].startswith("default: free")
    return cal
