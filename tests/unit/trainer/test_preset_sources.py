"""Each preset follows the release and file it names (trainer/presets.py SOURCES), checked on
numbers worked out by hand: the advantage's standard deviation (sample, ddof 1, in every source:
AReaL v1.0.3's NormConfig.std_unbiased, verl v0.7.0's torch.std), AReaL's cap of 5 with token
masking, TIS's truncation at 2, GRPO's ratio clip, DAPO's clip-higher, Dr. GRPO's constant
normaliser and GSPO's sequence ratio. Presets are resolved as the launcher resolves them."""
from __future__ import annotations

import math

import pytest
import torch
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import load_config
from tandem.trainer.advantages import sequence_advantages
from tandem.trainer.loss import ppo_token_loss
from tandem.trainer.objective_step import settings_from_config, shaping_from_config
from tandem.trainer.presets import PRESETS, SOURCES


def resolved(tmp_path, name, *overrides):
    p = tmp_path / "exp.yaml"
    p.write_text(GOOD_EXPERIMENT)
    return load_config(p, [f"trainer.algorithm={name}", "rollout.max_new_tokens=64", *overrides]).trainer


# Group a: rewards 5, -5, -5 (mean -5/3: baselined 20/3, -10/3, -10/3); group b: 5, 5 (no
# signal); one token each.
REWARDS, GROUPS, LENS = [5, -5, -5, 5, 5], list("aaabb"), [1] * 5
BASELINED = [20 / 3, -10 / 3, -10 / 3, 0, 0]
# batch scope: token mean 0, sum of squares 400/9 + 2 * 100/9 = 200/3 over 5 tokens: the sample
# variance divides by 4 (50/3), the population one by 5 (40/3)
BATCH_SAMPLE = [a / math.sqrt(50 / 3) for a in BASELINED]
# group scope: group a's sample variance 200/3 / 2 = 100/3; group b's std is 0: 0 / (0 + eps)
GROUP_SAMPLE = [a / math.sqrt(100 / 3) for a in BASELINED]
EXPECTED_ADVANTAGES = {"areal": BATCH_SAMPLE, "tis": BATCH_SAMPLE, "grpo": GROUP_SAMPLE, "dapo": GROUP_SAMPLE,
                       "gspo": GROUP_SAMPLE, "dr_grpo": BASELINED}


def test_every_preset_names_its_source_release_and_file():
    assert set(SOURCES) == set(PRESETS) == set(EXPECTED_ADVANTAGES)
    for name, text in SOURCES.items():
        assert any(rel in text for rel in ("AReaL v1.0.3", "verl v0.7.0")) or name == "tis", name
        assert ".py" in text or ".sh" in text or name == "tis", name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_advantages_by_hand(tmp_path, name):
    t = resolved(tmp_path, name)
    sh = shaping_from_config(t)
    adv = sequence_advantages(REWARDS, GROUPS, LENS, group_baseline=t.group_baseline,
                              normalize=t.normalize_advantages, leave_one_out=sh.leave_one_out,
                              norm_scope=sh.norm_scope, std=sh.norm_std)
    assert adv.tolist() == pytest.approx(EXPECTED_ADVANTAGES[name], rel=1e-5, abs=1e-9)


def _loss(t, log_w, log_r, adv, cu=None, ref=None):
    """ppo_token_loss of one micro-batch at logp = 0, prox = logp - log_r, behav = prox - log_w."""
    logp = torch.zeros(len(log_w), dtype=torch.float64, requires_grad=True)
    prox = logp.detach() - torch.tensor(log_r, dtype=torch.float64)
    behav = prox - torch.tensor(log_w, dtype=torch.float64)
    cu = torch.tensor([0, len(log_w)], dtype=torch.int32) if cu is None else cu
    mask = torch.ones(len(log_w), dtype=torch.bool)
    loss, stats = ppo_token_loss(logp, behav, prox, torch.tensor(adv, dtype=torch.float64), mask,
                                 settings_from_config(t), float(len(log_w)), cu_seqlens=cu, n_seqs=len(cu) - 1,
                                 ref_logp=logp.detach() if t.kl_coef else None)
    return float(loss.detach()), stats


def test_areal_masks_tokens_whose_weight_exceeds_five(tmp_path):
    t = resolved(tmp_path, "areal")
    assert (t.proximal, t.behav_weight, t.behav_weight_level, t.behav_imp_weight_cap) == \
        ("recompute", "cap-mask", "token", 5.0)
    # w = e^1.7 = 5.47 > 5: masked (still counted in N = 2); w = e^1.5 = 4.48 kept; r = 1, A = 1
    loss, stats = _loss(t, [1.7, 1.5], [0.0, 0.0], [1.0, 1.0])
    assert loss == pytest.approx(-math.exp(1.5) / 2, rel=1e-12) and stats["capped"] == 1.0


def test_areal_has_no_cap_where_there_is_no_behaviour_weight(tmp_path):
    for override in ("trainer.proximal=behaviour", "trainer.use_decoupled_loss=false"):
        assert resolved(tmp_path, "areal", override).behav_imp_weight_cap is None


def test_tis_truncates_at_two(tmp_path):
    t = resolved(tmp_path, "tis")
    # w = e^1 = 2.72 -> 2; w = e^0.5 kept; r = 1, A = 1; token-mean over 2
    loss, stats = _loss(t, [1.0, 0.5], [0.0, 0.0], [1.0, 1.0])
    assert loss == pytest.approx(-(2 + math.exp(0.5)) / 2, rel=1e-12) and stats["capped"] == 0.0


def test_grpo_clips_against_the_sampling_policy_per_sequence_mean(tmp_path):
    t = resolved(tmp_path, "grpo")
    # w = 1 (proximal: behaviour); r = e^0.3 = 1.35 -> clip 1.2 (A = 1), r = 1; seq mean of 2 tokens;
    # the KL to a reference equal to the policy is 0
    loss, _ = _loss(t, [0.0, 0.0], [0.3, 0.0], [1.0, 1.0])
    assert loss == pytest.approx(-(1.2 + 1.0) / 2, rel=1e-12)


def test_dapo_clips_higher_at_1_28(tmp_path):
    t = resolved(tmp_path, "dapo")
    # r = e^0.25 = 1.284 -> 1.28 (A = 1); r = e^-0.25 = 0.779 -> 0.8 with A = -1: min(-0.779, -0.8)
    loss, _ = _loss(t, [0.0, 0.0], [0.25, -0.25], [1.0, -1.0])
    assert loss == pytest.approx(-(1.28 - 0.8) / 2, rel=1e-12)


def test_dr_grpo_sums_tokens_over_the_length_limit(tmp_path):
    t = resolved(tmp_path, "dr_grpo")
    # r = 1, A = 1 on 3 tokens of one sequence: -(3) / (G = 1 * C = 64)
    loss, _ = _loss(t, [0.0] * 3, [0.0] * 3, [1.0] * 3)
    assert loss == pytest.approx(-3 / 64, rel=1e-12)


def test_gspo_clips_the_length_normalised_sequence_ratio(tmp_path):
    t = resolved(tmp_path, "gspo")
    # mean log-ratio (0.002 + 0) / 2 = 0.001: s = e^0.001 = 1.0010005 > 1 + 4e-4 -> 1.0004 (A = 1)
    loss, _ = _loss(t, [0.0, 0.0], [0.002, 0.0], [1.0, 1.0])
    assert loss == pytest.approx(-1.0004, rel=1e-12)
