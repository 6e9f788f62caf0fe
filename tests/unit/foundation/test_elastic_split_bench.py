"""benchmarks/elastic_split.py without its runs (they need a machine of several CPUs and minutes).

- On a machine where no elastic move fits (this 2-CPU one), `main` and the command line stop at
  once: one line naming the CPUs the machine has and the fewest that would do, in the preflight's
  own words (launcher/preflight.py's `layout_problems` says the same about the same config), a
  non-zero exit, nothing started (the unit tier refuses any process) and nothing written.
- On 16 CPUs the splits are disjoint CPU sets as the preflight accepts them with
  `launcher.elastic: true`: services first, one CPU per server, the trainer the rest; from the
  calibration's split both moves fit.
- The simulator's side (choosing the start split, predicting the gain) and the report run on a
  real recorded run's metrics (tests/support/recorded_run.py), elastic records added.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from recorded_run import write_recorded_run

import benchmarks.common as common
import tandem.launcher.plan as plan_module
from benchmarks import elastic_split as bench
from tandem.launcher.config import load_config
from tandem.launcher.elastic_moves import possible_moves
from tandem.launcher.plan import cpu_placement_for
from tandem.launcher.preflight import layout_problems
from tandem.launcher.simulate.calibrate import calibrate
from tandem.services.protocol import ExpDir


@pytest.fixture
def nothing_written(monkeypatch, tmp_path):
    """Benchmark output redirected under tmp_path; any scratch directory or run is an error."""
    monkeypatch.setattr(common, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "_record", False)   # restored after a test that parses --record
    monkeypatch.setattr(common, "_run_dir", None)
    monkeypatch.setattr(common, "_printed", [])
    monkeypatch.setattr(common, "machine", lambda: {"cpus": 16})

    def refused(*a, **k):
        raise AssertionError("the benchmark went on: it made a scratch directory or started a run")
    monkeypatch.setattr(bench, "kept_on_failure", refused)
    monkeypatch.setattr(bench, "tandem", refused)
    return tmp_path


def small_machine(monkeypatch):
    monkeypatch.setattr(bench, "available_cpus", lambda: (0, 1))


@pytest.mark.parametrize("quick", [False, True])
def test_main_stops_at_once_where_no_move_fits(monkeypatch, nothing_written, quick):
    small_machine(monkeypatch)
    with pytest.raises(bench.NotEnoughCpus) as e:
        bench.main(quick=quick)
    message = str(e.value)
    assert "\n" not in message
    assert "this machine's 2 CPU(s) (0-1)" in message and "needs at least 3 CPUs" in message, message
    assert "no move fits these CPUs" in message   # the preflight's reason
    assert not (nothing_written / "runs").exists() and not (nothing_written / "results").exists()


@pytest.mark.parametrize("argv", [[], ["--quick"], ["--record"]])
def test_the_command_line_says_it_in_one_line_and_exits_non_zero(monkeypatch, nothing_written, argv):
    small_machine(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["elastic_split", *argv])
    with pytest.raises(SystemExit) as e:
        bench.entry()
    # sys.exit(text): the text on stderr, exit status 1
    assert isinstance(e.value.code, str) and e.value.code.startswith("benchmarks.elastic_split: no elastic move fits")
    assert "\n" not in e.value.code
    assert not (nothing_written / "runs").exists() and not (nothing_written / "results").exists()


def test_the_refusal_is_the_preflights_own_check(monkeypatch):
    """The same config, checked by `tandem run`'s preflight on a 2-CPU machine, is refused for
    the same reason the benchmark gives."""
    layout = bench.layout_for((0, 1))
    cfg = load_config(bench.CONFIG, [*bench.base_overrides(False), *layout.overrides(layout.middle),
                                     "launcher.elastic=true"])
    monkeypatch.setattr(plan_module, "available_cpus", lambda: (0, 1))
    problems = layout_problems(cfg)
    assert problems and all(message in bench.elastic_refusal((0, 1)) for _, message in problems), problems


def test_on_16_cpus_every_split_is_disjoint_and_the_preflight_accepts_elastic(monkeypatch):
    cpus = tuple(range(16))
    assert bench.elastic_refusal(cpus) is None
    bench.require_a_move_fits(cpus)
    layout = bench.layout_for(cpus)
    assert layout.services == (0, 1) and layout.pool == tuple(range(2, 16))
    assert layout.candidates == list(range(1, 14)) and layout.middle == 7
    monkeypatch.setattr(plan_module, "available_cpus", lambda: cpus)
    for k in layout.candidates:
        cfg = load_config(bench.CONFIG, [*bench.base_overrides(False), *layout.overrides(k), "launcher.elastic=true"])
        placement = cpu_placement_for(cfg, available=cpus)
        assert placement.servers == tuple((c,) for c in range(2, 2 + k))
        assert placement.trainer_ranks == (tuple(range(2 + k, 16)),) and placement.services == (0, 1)
        assert not placement.shared_pools()
        assert layout_problems(cfg) == [], (k, layout_problems(cfg))
        assert len(placement.trainer_ranks[0]) == layout.trainer_cpus(k)
    middle = cpu_placement_for(load_config(bench.CONFIG, layout.overrides(layout.middle)), available=cpus)
    assert set(possible_moves(middle)) == {"to_train", "to_gen"}


@pytest.fixture
def recorded(tmp_path):
    return write_recorded_run(ExpDir(tmp_path / "run"))


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """The 16-CPU layout's start split, speeds and predicted gain from the recorded run's
    calibration: simulated once for the tests that read them (seconds each)."""
    cal = calibrate(write_recorded_run(ExpDir(tmp_path_factory.mktemp("predicted") / "run")).root)
    layout = bench.layout_for(range(16))
    start, speeds = bench.best_at_start(cal, layout, layout.middle, False)
    return cal, layout, start, speeds, bench.predicted_gain(cal, layout, layout.middle, False, bench.STEPS)


def test_the_start_split_is_the_fastest_predicted_and_the_prediction_follows_the_growth(predicted):
    cal, layout, start, speeds, p = predicted
    assert set(speeds) == set(layout.candidates) and all(v and v > 0 for v in speeds.values())
    assert speeds[start] == max(speeds.values())
    # the calibration's own split is simulated as calibrated: the trainer's cost unscaled
    cfg = bench.simulated_config(cal, layout, layout.middle, False, 1.0)
    assert bench.split_speed(cfg, cal, layout, layout.middle, layout.middle) == speeds[layout.middle]
    # a trainer twice as fast on the same CPUs favours more servers (the scaling assumption)
    faster = replace(cal, t0=cal.t0 / 2, t1=cal.t1 / 2)
    assert bench.best_at_start(faster, layout, layout.middle, False)[0] >= start

    assert [s.gen_gpus for s in p.splits] == layout.candidates
    assert [s.train_gpus for s in p.splits] == [layout.trainer_cpus(k) for k in layout.candidates]
    assert p.phases == 6 and p.total_steps == bench.STEPS and p.growth == bench.growing_lengths.GROWTH
    # lengths grow phase after phase: every split's steps get slower
    for ratio in (s.ratio for s in p.splits):
        rates = [phase[ratio] for phase in p.speeds]
        assert all(a > b for a, b in zip(rates, rates[1:], strict=False)), (ratio, rates)
    assert p.seconds["hindsight"] <= p.seconds["start"] and p.move_s > 0


def with_elastic_records(exp: ExpDir) -> None:
    """The recorded run as if elastic had made one move and refused another."""
    t = json.loads(exp.metrics.read_text().splitlines()[-1])["time"]
    extra = [
        {"time": t, "role": "launcher", "event": "elastic_decision", "step": 5, "servers": 1, "trainer_cpus": "1",
         "speeds_steps_per_h": {"1": 100.0, "2": 130.0}, "target": 2, "why": "test"},
        {"time": t, "role": "launcher", "event": "elastic_move", "step": 5, "direction": "to_gen", "ok": True,
         "server": "gen-1", "servers": 2, "trainer_cpus": "2", "detail": "test", "seconds": 3.0},
        {"time": t, "role": "launcher", "event": "elastic_move", "step": 10, "direction": "to_gen", "ok": False,
         "server": None, "servers": 2, "trainer_cpus": "2", "detail": "refused", "seconds": 0.0},
    ]
    with open(exp.metrics, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in extra)


def test_measure_and_report_on_a_recorded_run(recorded, predicted, monkeypatch, tmp_path):
    exp = recorded
    cal, layout, start, speeds, prediction = predicted
    monkeypatch.setattr(common, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "_record", False)
    monkeypatch.setattr(common, "_run_dir", None)
    monkeypatch.setattr(common, "_printed", [])
    monkeypatch.setattr(common, "machine", lambda: {"cpus": 16})
    (exp.root / "summary.json").write_text(json.dumps({"wall_s": 120.0}))
    fixed = bench.measure(exp.root, groups_per_step=16)
    assert fixed["steps"] == 10 and fixed["moves_made"] == 0 and fixed["servers_at_end"] is None
    assert fixed["audit_clean"] and fixed["audit"]["lost"] == 0 and fixed["audit"]["trained_twice"] == 0
    assert not bench.measure(exp.root, groups_per_step=17)["audit_clean"]   # a step short of its groups
    with_elastic_records(exp)
    (exp.root / "summary.json").write_text(json.dumps({"wall_s": 100.0}))
    elastic = bench.measure(exp.root, groups_per_step=16)
    assert elastic["moves_made"] == 1 and elastic["servers_at_end"] == 2 and len(elastic["decisions"]) == 1

    headline = bench.report(True, tuple(range(16)), layout, cal, start, speeds, prediction, fixed, elastic, 10)
    assert headline["elastic_gain_wall"] == pytest.approx(0.2) and headline["audits_clean"]
    assert headline["meets_issue_38"] and headline["elastic_moves_made"] == 1
    assert headline["sim_elastic_gain"] == pytest.approx(prediction.gain_over("start"), abs=1e-3)
    assert not (tmp_path / "runs").exists()   # --quick writes nothing
    bench.report(False, tuple(range(16)), layout, cal, start, speeds, prediction, fixed, elastic, 10)
    written = json.loads(next((tmp_path / "runs").glob("*/elastic_split.json")).read_text())
    assert written["elastic_gain_wall"] == pytest.approx(0.2)
    titles = [t["title"] for t in written["tables"]]
    assert any("moves" in t for t in titles) and any("audits" in t for t in titles)
