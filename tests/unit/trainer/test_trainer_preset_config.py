"""`trainer.algorithm` presets: each a bundle of keys, applied under whatever the experiment file
or the command line set explicitly; the resolved file reloads to the same config."""
from __future__ import annotations

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import ConfigError, ExperimentConfig, load_config, load_experiment, save_resolved
from tandem.trainer.presets import ALGORITHM_KEYS, PRESETS


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def _get(cfg, key):
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def test_areal_is_exactly_the_defaults(tmp_path):
    plain = load_config(write(tmp_path, GOOD_EXPERIMENT))
    defaults = ExperimentConfig()
    for key in ALGORITHM_KEYS:
        assert _get(plain, key) == _get(defaults, key), key
    assert plain.trainer.algorithm == "areal"
    assert load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=areal"]) == plain


def test_dapo_bundle_with_derived_values(tmp_path):
    cfg = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=dapo", "rollout.max_new_tokens=100"])
    t = cfg.trainer
    assert (t.proximal, t.eps_clip_low, t.eps_clip_high, t.loss_agg, t.adv_norm_scope) == \
        ("behaviour", 0.2, 0.28, "token-mean", "group")
    assert cfg.rollout.filter_all_equal and t.mask_truncated
    # buffer = 100 // 5; penalty = (5 - (-5)) / 2 with the default rewards
    assert (t.overlong_buffer, t.overlong_max_len, t.overlong_penalty) == (20, 100, 5.0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads_and_validates(tmp_path, name):
    cfg = load_config(write(tmp_path, GOOD_EXPERIMENT), [f"trainer.algorithm={name}"])
    assert cfg.trainer.algorithm == name


def test_dr_grpo_and_gspo_and_tis(tmp_path):
    dr = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=dr_grpo", "rollout.max_new_tokens=64"])
    assert (dr.trainer.loss_agg, dr.trainer.loss_agg_norm, dr.trainer.normalize_advantages) == \
        ("seq-mean-token-sum", 64.0, False)
    gspo = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=gspo"]).trainer
    assert (gspo.ratio_level, gspo.eps_clip_low, gspo.eps_clip_high) == ("sequence", 3e-4, 4e-4)
    tis = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=tis"]).trainer
    assert (tis.proximal, tis.behav_weight, tis.behav_imp_weight_cap) == ("recompute", "truncate", 2.0)


def test_explicit_keys_in_the_file_and_on_the_command_line_win(tmp_path):
    text = GOOD_EXPERIMENT.replace("trainer:\n", "trainer:\n  algorithm: dapo\n  eps_clip_high: 0.3\n") \
        + "rollout:\n  filter_all_equal: false\n"
    applied: dict = {}
    cfg = load_config(write(tmp_path, text), ["trainer.loss_agg=seq-mean-token-mean"], applied=applied)
    assert cfg.trainer.eps_clip_high == 0.3                   # the file's
    assert cfg.rollout.filter_all_equal is False              # the file's, though the preset says true
    assert cfg.trainer.loss_agg == "seq-mean-token-mean"      # the command line's
    assert cfg.trainer.eps_clip_low == 0.2                    # the preset's
    assert applied["trainer.eps_clip_high"] == ("explicit", 0.3)
    assert applied["trainer.eps_clip_low"] == ("preset", 0.2)
    # an explicit value equal to the default still counts as explicit
    cfg = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=grpo", "trainer.kl_coef=0.0"])
    assert cfg.trainer.kl_coef == 0.0 and cfg.trainer.adv_norm_scope == "group"


def test_resolved_config_reloads_identically(tmp_path):
    cfg = load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=gspo", "trainer.eps_clip_high=0.001"])
    save_resolved(cfg, tmp_path / "exp")
    assert load_experiment(tmp_path / "exp") == cfg


def test_mistakes_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trainer.algorithm: must be one of areal"):
        load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=ppo2"])
    # grpo's KL penalty runs on both backends (the Megatron backend keeps a reference model too)
    assert load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.algorithm=grpo",
                                                          "trainer.backend=megatron"]).trainer.kl_coef == 0.04
    with pytest.raises(ConfigError, match="trainer.behav_imp_weight_cap: behav_weight: truncate needs"):
        load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.behav_weight=truncate", "trainer.behav_imp_weight_cap=null"])
    with pytest.raises(ConfigError, match="trainer.loss_agg_norm"):
        load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.loss_agg_norm=100"])
    with pytest.raises(ConfigError, match="trainer.proximal: loglinear needs use_decoupled_loss"):
        load_config(write(tmp_path, GOOD_EXPERIMENT), ["trainer.proximal=loglinear", "trainer.use_decoupled_loss=false"])
