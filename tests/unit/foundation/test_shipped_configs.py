"""Every experiment file the project ships validates (cluster paths come from the environment)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.launcher.config import load_config

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path, monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("TANDEM_RUNS", str(tmp_path / "runs"))
    cfg = load_config(path)
    assert cfg.experiment.name == path.stem
    if cfg.launcher.backend == "slurm" and cfg.gen.backend == "sglang":
        assert cfg.experiment.exp_dir.startswith(str(tmp_path / "runs"))


def test_the_paper_shape_is_what_the_cluster_config_says():
    cfg = load_config(Path(__file__).parents[3] / "configs" / "math-r1-1.5b.yaml")
    assert (cfg.launcher.nodes, cfg.launcher.gpus_per_node, cfg.launcher.gen_train_ratio) == (16, 8, "3:1")
    assert (cfg.controller.max_staleness, cfg.trainer.groups_per_step, cfg.rollout.n_samples) == (4, 512, 16)
    assert cfg.rollout.max_new_tokens == 32768 and cfg.trainer.use_decoupled_loss


def test_the_multi_turn_cluster_config_runs_the_feedback_episode(monkeypatch, tmp_path):
    from tandem.rollout.workflow import load_workflow
    monkeypatch.setenv("TANDEM_RUNS", str(tmp_path / "runs"))
    cfg = load_config(Path(__file__).parents[3] / "configs" / "code-agent-r1-14b.yaml")
    assert load_workflow(cfg.rollout.workflow).__name__ == "code_with_feedback"
    assert cfg.rollout.max_turns == 3 and 0 < cfg.rollout.turn_discount <= 1
    assert (cfg.launcher.nodes * cfg.launcher.gpus_per_node, cfg.launcher.gen_train_ratio) == (128, "3:1")
    # Three turns of the longest generation still fit in a micro-batch's token budget.
    assert cfg.rollout.max_turns * cfg.rollout.max_new_tokens <= cfg.trainer.max_tokens_per_mb
