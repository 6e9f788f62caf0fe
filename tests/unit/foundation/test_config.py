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
