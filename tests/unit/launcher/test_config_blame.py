"""A config error blames what the user wrote, where they wrote it, once (launcher/config_source.py).

An override is named as the override, not as the file line it replaced; a key that only copies
another (`trainer.max_staleness: ${controller.max_staleness}`) is not blamed beside it; a
preset's value is blamed on `trainer.algorithm`.
"""
from __future__ import annotations

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import ConfigError, load_config

WITH_SAMPLING = GOOD_EXPERIMENT + "rollout:\n  temperature: 1.0\ncontroller:\n  max_staleness: 2\n"


def _error(tmp_path, text: str, *overrides: str) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_an_override_is_named_as_the_command_line_once(tmp_path):
    msg = _error(tmp_path, WITH_SAMPLING, "rollout.temperature=nan")
    assert msg == "command line: rollout.temperature: must be a finite number, got nan"


def test_a_copied_key_is_not_blamed_beside_the_key_the_user_wrote(tmp_path):
    text = WITH_SAMPLING.replace("max_staleness: 2", "max_staleness: -1")
    msg = _error(tmp_path, text)
    line = _line_of(text, "max_staleness: -1")
    assert msg == f"{tmp_path / 'exp.yaml'}:{line}: controller.max_staleness: must be >= 0 (0 means synchronous RL)"
    assert "trainer.max_staleness" not in msg


def test_the_copy_is_blamed_when_the_user_wrote_the_copy(tmp_path):
    msg = _error(tmp_path, WITH_SAMPLING, "trainer.max_staleness=-1")
    assert msg == "command line: trainer.max_staleness: must be >= 0"


def test_several_problems_one_line_each(tmp_path):
    text = WITH_SAMPLING.replace("max_staleness: 2", "max_staleness: -1")
    msg = _error(tmp_path, text, "rollout.temperature=inf")
    lines = msg.splitlines()
    assert lines[0] == "invalid configuration:"
    # non-finite values first (their message says more than a range check they also fail)
    assert [ln.strip().split(": ")[0:2] for ln in lines[1:]] == [
        ["command line", "rollout.temperature"],
        [f"{tmp_path / 'exp.yaml'}:{_line_of(text, 'max_staleness: -1')}", "controller.max_staleness"]]


def test_a_presets_value_is_blamed_on_the_algorithm_the_user_chose(tmp_path):
    text = GOOD_EXPERIMENT.replace("trainer:\n", "trainer:\n  algorithm: tis\n  use_decoupled_loss: false\n")
    msg = _error(tmp_path, text)
    assert msg.startswith(f"{tmp_path / 'exp.yaml'}:{_line_of(text, 'algorithm: tis')}: trainer.algorithm: ")
    assert "the preset's value of trainer.behav_weight" in msg and "\n" not in msg
