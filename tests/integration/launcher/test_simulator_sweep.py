"""`tandem plan --suggest` and `tandem simulate --sweep` end to end: a ratio grid evaluated over
worker processes, the recommended split and its plot, impossible ratios shown, not fatal.
"""
from __future__ import annotations

import pytest
from config_cases import SMALL_SIMULATION

from tandem.launcher.cli import main


@pytest.fixture
def small(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text(SMALL_SIMULATION)
    return f


def test_sweep_prints_a_grid_recommends_a_split_and_plots(small, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(["simulate", str(small), "--sweep", "ratio=1:1,3:1", "eta=0,2", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "eta=0" in text and "eta=2" in text and "recommended split at the configured eta=2" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_shows_impossible_ratios_instead_of_failing(small, capsys):
    # 1 node, gen TP 4: 7:1 leaves training with no GPU (8 GPUs, generation rounds to 8).
    assert main(["simulate", str(small), "gen.tp_size=4", "--sweep", "ratio=1:1,7:1", "eta=1"]) == 0
    text = capsys.readouterr().out
    assert "leaves training with no GPU" in text


def test_plan_suggest_recommends_a_ratio_and_prints_its_plan(small, capsys):
    assert main(["plan", str(small), "--suggest", "--ratios", "1:1,3:1"]) == 0
    text = capsys.readouterr().out
    assert "recommended split" in text and "Allocation plan" in text
