"""The loop refuses to start over an existing run unless asked to resume (checked before it binds
any socket). One real global step is in tests/integration/trainer/test_trainer_step.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.trainer.config import TrainerConfig
from tandem.trainer.loop import Trainer


def experiment(model_dir, **trainer_kw):
    t = TrainerConfig(temperature=1.0, max_staleness=0, groups_per_step=4, **trainer_kw)
    t.optim.lr = 1e-2
    return SimpleNamespace(trainer=t, experiment=SimpleNamespace(model=str(model_dir), seed=0),
                           gen=SimpleNamespace(num_servers=1))


def test_refuses_to_start_over_a_run_without_resume(exp, small_model_dir):
    (exp.checkpoints / "step-3").mkdir(parents=True)
    with pytest.raises(SystemExit, match="--resume"):
        Trainer(experiment(small_model_dir), exp)
