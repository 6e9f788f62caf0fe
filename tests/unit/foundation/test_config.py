"""Config files in-process: the resolved config round-trips through the experiment directory, and
docs/configuration.md is current. The CLI's error messages and exit codes (a real `tandem`
process) are in tests/integration/foundation/test_config_cli.py.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import ConfigError, load_config, load_experiment, save_resolved
from tandem.launcher.config_docs import render


def write(tmp_path, text, name="exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_resolved_config_round_trips_through_the_experiment_dir(tmp_path):
    cfg = load_config(write(tmp_path, GOOD_EXPERIMENT), ["experiment.seed=7"])
    save_resolved(cfg, tmp_path / "exp")
    back = load_experiment(tmp_path / "exp")
    assert back == cfg
    with pytest.raises(ConfigError, match="no such file"):
        load_experiment(tmp_path / "elsewhere")


def test_loading_leaves_the_shared_defaults_as_they_were(tmp_path):
    """The structured defaults are made once and shared by every load (launcher/config.py:
    _schema): no file, override, preset or interpolation of one load may reach the next."""
    path, least = write(tmp_path, GOOD_EXPERIMENT), ["experiment.name=n", "experiment.model=m"]
    fresh = load_config(None, least)
    load_config(path, ["trainer.algorithm=dapo", "trainer.total_steps=3", "rollout.n_samples=5"])
    load_config(None, [*least, "trainer.algorithm=dapo"])
    with pytest.raises(ConfigError, match="missing required value"):
        load_config(None)    # the defaults alone: the preset is applied before the check
    assert load_config(None, least) == fresh


def test_configuration_reference_is_current():
    doc = Path(__file__).parents[3] / "docs" / "configuration.md"
    assert doc.read_text() == render(), "docs/configuration.md is stale: run `make docs`"


def _float_keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_keys(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}"


def test_no_float_setting_accepts_nan_or_infinity(tmp_path):
    """A NaN passes every range check (comparisons with NaN are false): each float setting of
    the schema, set to nan or inf, is refused naming its key (all of them in one load: the
    loader reports every problem at once, so one key's error cannot hide another's)."""
    path = write(tmp_path, GOOD_EXPERIMENT)
    keys = list(_float_keys(load_config(path)))
    assert "rollout.temperature" in keys and "trainer.optim.lr" in keys
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError) as err:
            load_config(path, [f"{key}={bad}" for key in keys])
        missed = [k for k in keys if not re.search(rf"(^|\s){re.escape(k)}: must be a finite number", str(err.value))]
        assert not missed, missed



@pytest.mark.parametrize("overrides, why", [
    (["gen.weight_relay=true", "trainer.weight_sync=broadcast"], r"gen\.weight_relay: relays versions published on "
                                                                 r"disk, but trainer\.weight_sync is 'broadcast'"),
    (["gen.weight_relay=true", "trainer.lora.rank=8", "trainer.lora.sync=adapter"],
     r"gen\.weight_relay: relays whole models; with trainer\.lora\.sync: adapter"),
])
def test_the_weight_relay_is_refused_where_nothing_whole_is_on_disk(tmp_path, overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(write(tmp_path, GOOD_EXPERIMENT), overrides)
    relayed = load_config(write(tmp_path, GOOD_EXPERIMENT), ["gen.weight_relay=true"])
    assert relayed.gen.weight_relay and relayed.trainer.weight_sync == "disk"


def test_colon_joined_digits_stay_what_was_written(tmp_path):
    """YAML 1.1 reads `7:1` as 421 (base 60): `launcher.gen_train_ratio=7:1` was refused as
    "got '421'". A file's value and an override's are the text written."""
    path = tmp_path / "exp.yaml"
    path.write_text(GOOD_EXPERIMENT + "launcher:\n  gen_train_ratio: 7:1\n")
    assert load_config(path).launcher.gen_train_ratio == "7:1"
    assert load_config(path, ["launcher.gen_train_ratio=5:3"]).launcher.gen_train_ratio == "5:3"
    assert load_config(path, ["trainer.total_steps=12"]).trainer.total_steps == 12   # numbers stay numbers
    with pytest.raises(ConfigError, match=r"gen_train_ratio: must look like '3:1' \(two positive integers\), got '7:1:2'"):
        load_config(path, ["launcher.gen_train_ratio=7:1:2"])


def test_every_mistake_is_said_not_the_first(tmp_path, capsys):
    """A typo in the file used to hide every other mistake (a key typo hid `gen.tp_size: 3`): each
    setting that cannot be merged is named, and the rest is still checked."""
    from tandem.launcher.cli import main

    path = tmp_path / "exp.yaml"
    path.write_text(GOOD_EXPERIMENT.replace("groups_per_step: 8", "groups_per_step: many")
                    + "gen:\n  num_servrs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["trainer.optim.lrx=1", "trainer.total_steps=0"])
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid configuration:" and len(lines) == 5, lines
    text = str(err.value)
    assert "gen.num_servrs: unknown key (did you mean 'gen.num_servers'?)" in text
    assert "trainer.groups_per_step: wrong type" in text
    assert "override 'trainer.optim.lrx=1': trainer.optim.lrx: unknown key" in text
    assert "command line: trainer.total_steps: must be >= 1" in text
    # ... and with the checks made before a launch (the plan's layout), in one message
    assert main(["config", "check", "configs/math-r1-1.5b.yaml", "gen.tp_size=3", "trainer.total_step=3",
                 "--skip-files"]) == 2
    err = capsys.readouterr().err
    assert "trainer.total_step: unknown key" in err and "gen.tp_size=3 does not divide" in err, err
