"""The README's simulator commands on the shipped cluster config work on a machine without the
cluster's model directory, and a sweep that simulated nothing is never a success.

`configs/math-r1-1.5b.yaml` names `/shared/models/DeepSeek-R1-Distill-Qwen-1.5B`; a laptop has no
such directory, so its config.json cannot be read. The model's shape is then the
configs/hardware/models.yaml entry the directory's name matches (its Hub `source`), and a name
that matches nothing is one clear error, not a table of `-` that exits 0. Sweeps run in-process
here (`--jobs 1`) and are shortened (64 groups, 3 steps) where only the shape lookup matters;
tests/integration/foundation/test_doc_commands.py runs the README's lines as written.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.launcher.cli import main
from tandem.launcher.config import ConfigError
from tandem.launcher.simulate.hardware import HARDWARE_DIR, _read_yaml, load_model_shape, shape_name_for

REPO = Path(__file__).resolve().parents[3]
CLUSTER = str(REPO / "configs" / "math-r1-1.5b.yaml")
SHORT = ["trainer.groups_per_step=64", "simulate.steps=3"]


@pytest.fixture(autouse=True)
def no_model_dirs(monkeypatch):
    """The config's paths default to /shared/... unless TANDEM_MODELS says otherwise."""
    monkeypatch.delenv("TANDEM_MODELS", raising=False)
    assert not Path("/shared/models/DeepSeek-R1-Distill-Qwen-1.5B/config.json").exists()


def test_the_cluster_configs_sweep_simulates_every_point(capsys):
    assert main(["simulate", CLUSTER, *SHORT, "--sweep", "ratio=1:1,3:1", "eta=0,4", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "not simulated" not in out and "fastest: ratio" in out
    rows = [line for line in out.splitlines() if line.startswith(("│ 1:1", "│ 3:1"))]
    assert len(rows) == 2 and not any(" - " in r for r in rows), rows


def test_plan_suggest_on_the_cluster_config_recommends_a_split(capsys):
    assert main(["plan", CLUSTER, *SHORT, "--suggest", "--ratios", "1:1,3:1", "--jobs", "1"]) == 0
    assert "recommended split at the configured eta=4" in capsys.readouterr().out


@pytest.mark.parametrize(("model", "shape"), [
    ("/shared/models/DeepSeek-R1-Distill-Qwen-1.5B", "R1-Distill-Qwen-1.5B"),
    ("/m/deepseek-r1-distill-qwen-7b/", "R1-Distill-Qwen-7B"),
    ("/m/Qwen2.5-14B", "Qwen2.5-14B"),
    ("/m/R1-Distill-Qwen-32B", "R1-Distill-Qwen-32B"),
    ("/m/DeepSeek-R1-Distill-Qwen-1.5B-finetuned", None),
])
def test_a_model_directory_names_its_shape(model, shape):
    assert shape_name_for(model, _read_yaml(HARDWARE_DIR / "models.yaml")) == shape
    if shape:
        assert load_model_shape("", model) == load_model_shape(shape)


def test_an_unknown_model_is_one_clear_error_and_the_sweep_fails(capsys):
    with pytest.raises(ConfigError, match="names no model in configs/hardware/models.yaml.*R1-Distill-Qwen-7B"):
        load_model_shape("", "/nowhere/MyOwnModel-3B")
    code = main(["simulate", CLUSTER, "experiment.model=/nowhere/MyOwnModel-3B", *SHORT,
                 "--sweep", "ratio=1:1,3:1", "eta=0", "--jobs", "1"])
    captured = capsys.readouterr()
    assert code == 2
    assert "'MyOwnModel-3B' names no model" in captured.out
    assert "no point of the sweep could be simulated" in captured.err


def test_a_sweep_of_impossible_points_is_not_a_success(capsys):
    # 15:1 on 2 GPUs leaves training nothing; every cell is '-' with the plan's reason.
    code = main(["simulate", CLUSTER, "launcher.nodes=1", "launcher.gpus_per_node=2", *SHORT,
                 "--sweep", "ratio=15:1", "eta=0", "--jobs", "1"])
    captured = capsys.readouterr()
    assert code == 2 and "not simulated:" in captured.out
    assert "no point of the sweep could be simulated" in captured.err
