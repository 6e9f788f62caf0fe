"""The elastic split on the simulator's side: lengths that grow during the run
(`simulate.length_growth`), the decision rule shared with the runtime (launcher/elastic_policy.py),
and `tandem simulate --elastic`'s prediction of the gain."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import ConfigError, load_config
from tandem.launcher.elastic_policy import choose_split
from tandem.launcher.simulate.elastic import candidate_splits, predict, replay
from tandem.launcher.simulate.scenario import build, lengths_for, samples_used, simulate
from tandem.launcher.simulate.workload import grow_lengths

SPLITS = ["1:3", "2:2", "3:1"]


# ---- the rule -------------------------------------------------------------------------------

def test_no_move_below_or_at_the_threshold():
    # the best is 2:2, faster than 1:3 by exactly 25% (exact in binary), then by 10%: neither is
    # "more than" 25%; by 25.1% it is
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "2:2": 125.0, "3:1": 90.0}, 0.25) is None
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "2:2": 110.0, "3:1": 90.0}, 0.25) is None
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "2:2": 125.1, "3:1": 90.0}, 0.25) == "2:2"


def test_no_move_when_equal_even_without_a_threshold():
    assert choose_split(SPLITS, "2:2", {"1:3": 100.0, "2:2": 100.0, "3:1": 100.0}, 0.0) is None
    assert choose_split(SPLITS, "2:2", {"1:3": 100.0, "2:2": 100.0, "3:1": 100.1}, 0.0) == "3:1"


def test_moves_one_unit_towards_a_far_best():
    splits = ["1:7", "2:6", "3:5", "4:4", "5:3"]
    speeds = {"1:7": 50.0, "2:6": 60.0, "3:5": 70.0, "4:4": 80.0, "5:3": 200.0}
    assert choose_split(splits, "1:7", speeds, 0.15) == "2:6"      # not 5:3
    assert choose_split(splits, "5:3", speeds, 0.15) is None        # already the best
    assert choose_split(splits, "4:4", speeds, 0.15) == "5:3"
    # and towards fewer generation GPUs as well
    down = dict(zip(splits, reversed(speeds.values()), strict=True))   # 1:7 is now the best
    assert choose_split(splits, "4:4", down, 0.15) == "3:5"


def test_never_steps_into_a_predicted_loss():
    # 3:1 is far better, but the neighbour on the way is slower than here: stay
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "2:2": 90.0, "3:1": 200.0}, 0.15) is None
    # a neighbour that cannot run (None, missing) is never a target
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "2:2": None, "3:1": 200.0}, 0.15) is None
    assert choose_split(SPLITS, "1:3", {"1:3": 100.0, "3:1": 200.0}, 0.15) is None


def test_hysteresis_the_same_predictions_never_move_back():
    speeds = {"1:3": 100.0, "2:2": 130.0, "3:1": 90.0}
    to = choose_split(SPLITS, "1:3", speeds, 0.15)
    assert to == "2:2"
    assert choose_split(SPLITS, to, speeds, 0.15) is None


def test_rule_rejects_bad_input():
    with pytest.raises(ValueError, match="min_gain"):
        choose_split(SPLITS, "1:3", {}, -0.1)
    with pytest.raises(ValueError, match="not one of"):
        choose_split(SPLITS, "5:3", {}, 0.1)
    assert choose_split(SPLITS, "1:3", {"2:2": 500.0}, 0.1) is None   # nothing measured here yet


# ---- growing lengths ------------------------------------------------------------------------

def _cfg(*overrides):
    base = ["experiment.name=t", "experiment.model=m", "launcher.backend=slurm", "gen.backend=sglang",
            "simulate.model_size=R1-Distill-Qwen-1.5B", "simulate.hardware=H800",
            "launcher.nodes=4", "launcher.gpus_per_node=2", "trainer.groups_per_step=64",
            "rollout.n_samples=8", "rollout.max_new_tokens=8192", "controller.max_concurrent_groups=100000",
            "rollout.concurrency=100000", "controller.max_staleness=4", "simulate.output_median=64",
            "simulate.output_sigma=0.5", "simulate.steps=4", "simulate.warmup_steps=2",
            "rollout.max_prompt_tokens=512", "trainer.max_tokens_per_mb=8704", "trainer.total_steps=200"]
    return load_config(None, base + list(overrides))


def test_growth_one_leaves_the_lengths_and_the_prediction_unchanged():
    x = np.array([5, 10, 8192, 300])
    assert grow_lengths(x, 1.0, 8192, used=4) is x
    cfg, grown = _cfg(), _cfg("simulate.length_growth=1.0")
    assert simulate(cfg)[1].step_times == simulate(grown)[1].step_times


def test_growth_lengthens_late_samples_by_the_stated_factor():
    x = np.full(1000, 100)
    y = grow_lengths(x, 8.0, 10**6, used=1000)
    assert y[0] == 100                                    # 8 ** 0
    assert y[500] == round(100 * 8 ** 0.5)                # halfway: sqrt(8)
    assert y[999] == round(100 * 8 ** (999 / 1000))
    assert np.all(np.diff(y) >= 0)
    # clipped to max_new_tokens; samples past the run's are left as drawn
    z = grow_lengths(np.full(20, 100), 8.0, 500, used=10)
    assert z.max() == 500 and np.all(z[10:] == 100)
    # a phase: the part of the run from a to b
    p = grow_lengths(x, 8.0, 10**6, used=1000, span=(0.5, 1.0))
    assert p[0] == round(100 * 8 ** 0.5) and p[999] == round(100 * 8 ** (0.5 + 0.5 * 999 / 1000))


def test_a_simulated_run_sees_the_whole_growth_however_much_of_the_draw_it_uses():
    # each configuration grows its own consumed prefix from x1 to xgrowth (a shrunk slice too)
    cfg = _cfg("simulate.length_growth=4")
    sc = build(cfg)
    used = samples_used(sc.setup)
    base = lengths_for(cfg, cfg.controller.max_staleness)
    grown = grow_lengths(base, 4.0, cfg.rollout.max_new_tokens, used)
    ratio = grown[:used] / base[:used]
    assert ratio[0] == pytest.approx(1, abs=0.05) and ratio[used - 1] == pytest.approx(4, rel=0.05)
    assert simulate(cfg)[1].steps_per_hour < simulate(_cfg())[1].steps_per_hour   # longer answers, slower


def test_length_growth_below_one_is_refused():
    with pytest.raises(ConfigError, match="simulate.length_growth"):
        _cfg("simulate.length_growth=0.5")


def test_launcher_elastic_keys_are_validated():
    with pytest.raises(ConfigError, match="launcher.elastic_min_gain"):
        _cfg("launcher.elastic_min_gain=-0.1")
    with pytest.raises(ConfigError, match="launcher.elastic_every_steps"):
        _cfg("launcher.elastic_every_steps=0")


# ---- the prediction -------------------------------------------------------------------------

def test_candidates_are_whole_nodes_and_one_split_is_an_error():
    assert [s.ratio for s in candidate_splits(_cfg())] == ["2:6", "4:4", "6:2"]
    with pytest.raises(ConfigError, match="needs two or more"):
        candidate_splits(_cfg("launcher.nodes=1", "launcher.gpus_per_node=2", "trainer.tensor_parallel=2",
                              "gen.tp_size=2"))
    with pytest.raises(ConfigError, match="embedded"):
        candidate_splits(_cfg("gen.backend=embedded"))


def test_growing_lengths_move_the_split_and_elastic_beats_the_start():
    # Short answers at first: the trainer is the bottleneck, so fewer generation GPUs are best;
    # 32x longer by the end: generation is, and the best split has more generation GPUs.
    pred = predict(_cfg("simulate.length_growth=32"))
    share = {s.ratio: s.gen_gpus for s in pred.splits}
    assert share[pred.hindsight.ratio] > share[pred.start.ratio]
    assert pred.moves and all(share[b] == share[a] + 2 for _, a, b in pred.moves)   # one node each, upwards
    assert pred.seconds["elastic"] < pred.seconds["start"]
    assert pred.gain_over("start") > 0
    assert pred.seconds["hindsight"] <= pred.seconds["start"]
    again = (pred.splits, pred.speeds, pred.total_steps, pred.every_steps)
    # each move is paid: the same path without its moves' price is faster by exactly that
    free = replay(*again, pred.min_gain, move_s=0.0)
    assert free.moves == pred.moves
    assert free.seconds["elastic"] == pytest.approx(pred.seconds["elastic"] - pred.move_s * len(pred.moves))
    # a threshold nothing reaches: no move, elastic = fixed at the start
    never = replay(*again, min_gain=100.0, move_s=pred.move_s)
    assert not never.moves and never.seconds["elastic"] == never.seconds["start"]
    # decisions use only the past: the first move comes after the phase where the best changed
    changed = next(p for p, row in enumerate(pred.speeds) if max(row, key=row.get) != pred.start.ratio)
    assert pred.moves[0][0] >= pred.total_steps * (changed + 1) / pred.phases


def test_without_growth_elastic_makes_no_move():
    pred = predict(_cfg())
    assert not pred.moves
    assert pred.seconds["elastic"] == pred.seconds["start"] == pred.seconds["hindsight"]
    assert all(row == pred.speeds[0] for row in pred.speeds)


def test_cli_elastic_prints_the_three_runs_and_refuses_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # rich: one line per table row
    f = tmp_path / "el.yaml"
    f.write_text("experiment: {name: el, model: m}\n"
                 "launcher: {backend: slurm, nodes: 3, gpus_per_node: 2}\n"
                 "gen: {backend: sglang}\n"
                 "rollout: {n_samples: 4, max_new_tokens: 4096, max_prompt_tokens: 512}\n"
                 "controller: {max_staleness: 2}\n"
                 "trainer: {groups_per_step: 16, max_tokens_per_mb: 4608, total_steps: 20}\n"
                 "simulate: {model_size: R1-Distill-Qwen-1.5B, output_median: 256, length_growth: 4, steps: 2}\n")
    out = tmp_path / "el.json"
    assert main(["simulate", str(f), "--elastic", "--phases", "2", "--jobs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("fastest at the start", "fastest in hindsight", "elastic", "Steps / hour by phase"):
        assert row in text
    pred = json.loads(out.read_text())
    assert len(pred["phases"]) == 2 and pred["elastic"]["seconds"] > 0
    assert main(["simulate", str(f), "--elastic", "--sweep", "eta=0,1"]) == 2
    assert "separate questions" in capsys.readouterr().err
    assert main(["simulate", str(f), "launcher.nodes=2", "--elastic"]) == 2   # 1:1 is the only split
    assert "needs two or more" in capsys.readouterr().err
