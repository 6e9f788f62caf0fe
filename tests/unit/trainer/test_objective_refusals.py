"""The config check refuses every combination of the objective's keys that does nothing or
leaves an estimate unbounded, naming both keys (issue 36; the list is docs/algorithms.md's
"Refused combinations"). Before, `behav_weight: truncate` under `proximal: behaviour` (any of the
grpo, dapo, dr_grpo, gspo presets) and a seq-product weight with no cap were accepted."""
from __future__ import annotations

import re

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import ConfigError, load_config
from tandem.trainer.config import TrainerConfig
from tandem.trainer.presets import PRESETS


def problems(**kw) -> list[tuple[str, str]]:
    return TrainerConfig(temperature=1.0, max_staleness=0, **kw).problems()


# (settings, the key refused, the other key its message must name)
REFUSED = [
    (dict(proximal="behaviour", behav_weight="truncate", behav_imp_weight_cap=2.0), "behav_weight", "proximal"),
    (dict(proximal="behaviour", behav_weight="mask", behav_imp_weight_cap=2.0), "behav_weight", "proximal"),
    (dict(use_decoupled_loss=False, behav_weight="truncate", behav_imp_weight_cap=2.0), "behav_weight",
     "use_decoupled_loss"),
    (dict(proximal="behaviour", behav_imp_weight_cap=5.0), "behav_imp_weight_cap", "proximal"),
    (dict(use_decoupled_loss=False), "behav_imp_weight_cap", "use_decoupled_loss"),   # the default cap 5
    (dict(proximal="behaviour", behav_imp_weight_cap=None, behav_weight_level="seq-mean"), "behav_weight_level",
     "proximal"),
    (dict(behav_imp_weight_low=0.5), "behav_imp_weight_low", "behav_weight"),
    (dict(behav_weight="truncate", behav_imp_weight_cap=2.0, behav_imp_weight_low=0.5), "behav_imp_weight_low",
     "behav_weight"),
    (dict(behav_weight_level="seq-product", behav_imp_weight_cap=None), "behav_imp_weight_cap",
     "behav_weight_level"),
    (dict(behav_imp_weight_cap=1e9), "behav_imp_weight_cap", "log_ratio_clamp"),          # e^20 = 4.9e8
    (dict(behav_imp_weight_cap=100.0, log_ratio_clamp=4.0), "behav_imp_weight_cap", "log_ratio_clamp"),
    (dict(kl_estimator="k1"), "kl_estimator", "kl_coef"),
    (dict(kl_clamp=5.0), "kl_clamp", "kl_coef"),
    (dict(normalize_advantages=False, adv_norm_scope="group"), "adv_norm_scope", "normalize_advantages"),
    (dict(normalize_advantages=False, adv_norm_std="population"), "adv_norm_std", "normalize_advantages"),
    (dict(eps_clip=0.3, eps_clip_low=0.2, eps_clip_high=0.28), "eps_clip", "eps_clip_low"),
]


@pytest.mark.parametrize("kw, key, other", REFUSED, ids=[f"{k}-{o}" for _, k, o in REFUSED])
def test_no_effect_or_no_bound_is_refused_naming_both_keys(kw, key, other):
    found = [(k, m) for k, m in problems(**kw) if k == key]
    assert found, problems(**kw)
    assert any(f"trainer.{other}" in m for _, m in found), found


@pytest.mark.parametrize("kw, key", [
    (dict(log_ratio_clamp=0.0), "log_ratio_clamp"), (dict(log_ratio_clamp=50.0), "log_ratio_clamp"),
    (dict(kl_clamp=0.0, kl_coef=0.1), "kl_clamp"), (dict(adv_norm_std="median"), "adv_norm_std"),
])
def test_bounds_out_of_range_are_refused(kw, key):
    assert key in {k for k, _ in problems(**kw)}


@pytest.mark.parametrize("kw", [
    dict(),                                                    # areal: cap 5 at token level
    dict(proximal="behaviour", behav_imp_weight_cap=None),     # standard PPO
    dict(use_decoupled_loss=False, behav_imp_weight_cap=None),
    dict(behav_imp_weight_cap=None),                           # no cap at token level: e^20 bounds it
    dict(behav_weight_level="seq-product", behav_imp_weight_cap=10.0),
    dict(behav_weight_level="seq-mean", behav_imp_weight_cap=None),
    dict(behav_weight="mask", behav_imp_weight_cap=2.0, behav_imp_weight_low=0.5),
    dict(kl_coef=0.04, kl_estimator="k1", kl_clamp=5.0),
    dict(eps_clip_low=0.2, eps_clip_high=0.28),
    dict(normalize_advantages=False),
])
def test_meaningful_combinations_pass(kw):
    assert problems(**kw) == []


def write(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text(GOOD_EXPERIMENT)
    return p


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_standard_ppo_presets_refuse_a_behaviour_weight_mode(tmp_path, name):
    assert PRESETS[name]["trainer.proximal"] == "behaviour"
    cfg = load_config(write(tmp_path), [f"trainer.algorithm={name}"]).trainer
    assert cfg.behav_imp_weight_cap is None and cfg.behav_weight == "cap-mask"    # the preset's own: no no-op
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path), [f"trainer.algorithm={name}", "trainer.behav_weight=truncate",
                                      "trainer.behav_imp_weight_cap=2.0"])
    text = str(e.value)
    assert re.search(r"trainer\.behav_weight\b", text) and "trainer.proximal: behaviour" in text, text


def test_every_preset_still_passes_with_standard_ppo_on_top(tmp_path):
    """The areal preset's cap follows its proximal policy, so the staleness ablation's naive runs
    (trainer.proximal=behaviour over the default preset) are not refused."""
    for name in sorted(PRESETS):
        if name == "tis":
            continue          # truncation is tis: under proximal: behaviour it would do nothing
        load_config(write(tmp_path), [f"trainer.algorithm={name}", "trainer.proximal=behaviour"])
    with pytest.raises(ConfigError, match="trainer.behav_weight"):
        load_config(write(tmp_path), ["trainer.algorithm=tis", "trainer.proximal=behaviour"])
