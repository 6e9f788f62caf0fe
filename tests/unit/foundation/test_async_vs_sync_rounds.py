"""benchmarks/async_vs_sync.py's rounds (`--repeats N`), without its runs (half an hour each):
how one variant's rounds become one result, and a bad count refused before anything starts."""
from __future__ import annotations

import pytest

from benchmarks import async_vs_sync as bench


def _round(s_per_step: float, staleness: int, accuracy: float | None, eval_n: int) -> dict:
    return {"s_per_step": s_per_step, "staleness_max": staleness, "accuracy_before": accuracy,
            "accuracy_after": accuracy, "eval_n": eval_n, "role_cpu_s": {"trainer": s_per_step},
            "train_us_per_token": 10 * s_per_step}


def test_rounds_become_medians_with_the_worst_staleness_and_the_first_rounds_accuracy():
    rounds = [_round(2.0, 3, 0.5, 300), _round(3.0, 4, None, 0), _round(2.2, 2, None, 0)]
    out = bench.median_of_rounds(rounds)
    assert out["s_per_step"] == 2.2 and out["train_us_per_token"] == pytest.approx(22.0)
    assert out["staleness_max"] == 4
    # measured in the first round only: a median would report eval_n 0 and no accuracy
    assert (out["accuracy_after"], out["eval_n"]) == (0.5, 300)
    assert out["role_cpu_s"] == {"trainer": 2.0}
    assert out["s_per_step_rounds"] == [2.0, 3.0, 2.2]
    assert out["s_per_step_spread"] == pytest.approx((3.0 - 2.0) / 2.2)


def test_one_round_is_reported_as_it_was_measured():
    one = _round(2.0, 3, 0.5, 300)
    assert bench.median_of_rounds([one]) == one


def test_a_count_below_one_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        bench.main(repeats=0)


def test_each_pools_speed_is_compared_with_the_eta0_fit_at_the_same_work(tmp_path):
    """pools_vs_fit: a run whose decode steps took 1.25x and whose trainer took 1.1x what the
    eta-0 fit prices at the run's own moments and token counts reads +25% and +10%."""
    import json
    from types import SimpleNamespace
    fit = SimpleNamespace(d0=0.004, d1=0.0001, d2=1e-6, t0=0.1, t1=1e-4)
    moments = {"1": 100, "f": 110, "n": 5000, "p": 200000}
    priced = fit.d0 * 110 + fit.d1 * 5000 + fit.d2 * 200000
    records = [{"role": "gen", "event": "gen_window", "gen_decode_moments": {**moments, "t": 1.25 * priced}},
               {"role": "trainer", "event": "step", "train_tokens": 4000, "train_step_s": 1.1 * (0.1 + 0.4)},
               {"role": "trainer", "event": "step", "train_tokens": 6000, "train_step_s": 1.1 * (0.1 + 0.6)},
               {"role": "gen", "event": "step", "train_tokens": 1, "train_step_s": 99.0}]   # not the trainer's
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = bench.pools_vs_fit(fit, tmp_path)
    assert out["decode_vs_eta0_fit"] == pytest.approx(0.25) and out["train_vs_eta0_fit"] == pytest.approx(0.10)
    (tmp_path / "metrics.jsonl").write_text("")
    assert bench.pools_vs_fit(fit, tmp_path) == {"decode_vs_eta0_fit": None, "train_vs_eta0_fit": None}


def test_the_diagnostic_scales_the_eta0_fit_by_a_runs_pool_speeds_and_leaves_the_fit_alone():
    from types import SimpleNamespace
    fit = SimpleNamespace(d0=1.0, d1=2.0, d2=3.0, t0=4.0, t1=5.0, load_s=0.5)
    out = bench.at_pool_speeds(fit, {"decode_vs_eta0_fit": 0.25, "train_vs_eta0_fit": -0.1})
    assert (out.d0, out.d1, out.d2) == pytest.approx((1.25, 2.5, 3.75))
    assert (out.t0, out.t1) == pytest.approx((3.6, 4.5)) and out.load_s == 0.5
    assert (fit.d0, fit.t1) == (1.0, 5.0)
    same = bench.at_pool_speeds(fit, {"decode_vs_eta0_fit": None, "train_vs_eta0_fit": None})
    assert (same.d0, same.t1) == (1.0, 5.0)   # no figure: the fit as it is
