"""The objective's pieces (trainer/objectives.py) and their composition (trainer/loss.py) against
numbers worked out by hand in the comments, never by calling the code under test."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.trainer import objectives as obj
from tandem.trainer.loss import PPOSettings, ppo_token_loss

E = math.e


def t(values, **kw):
    return torch.tensor(values, dtype=torch.float64, **kw)


# Two sequences in one micro-batch: seq 0 = tokens 0..2 (token 0 is prompt), seq 1 = tokens 3..4
# (token 3 is prompt).
CU = torch.tensor([0, 3, 5], dtype=torch.int32)
MASK = torch.tensor([False, True, True, False, True])
SEG = torch.tensor([0, 0, 0, 1, 1])


def test_segment_ids_follow_cu_seqlens():
    assert obj.segment_ids(CU).tolist() == SEG.tolist()


def test_loglinear_proximal_interpolates_by_version_distance():
    logp, behav = t([-1.0, -2.0, -0.5]), t([-1.5, -2.0, -1.0])
    versions = torch.tensor([3, 5, 4])
    # V = 5, update k = 1 of n = 2: v_theta = 5.5; alpha = (5 - v_b) / (5.5 - v_b)
    #   v_b = 3: alpha = 2 / 2.5 = 0.8;  prox = -1.5 + 0.8 * (-1.0 + 1.5) = -1.1
    #   v_b = 5: alpha = 0 / 0.5 = 0;    prox = behav = -2.0
    #   v_b = 4: alpha = 1 / 1.5 = 2/3;  prox = -1.0 + 2/3 * (-0.5 + 1.0) = -2/3
    prox = obj.proximal_logp("loglinear", logp, behav, None, versions, 5, 0.5)
    assert prox.tolist() == pytest.approx([-1.1, -2.0, -2 / 3], abs=1e-12)
    # the first update (k = 0) runs with the start parameters: prox = logp, no gradient
    lp = t([-1.0, -2.0, -0.5], requires_grad=True)
    first = obj.proximal_logp("loglinear", lp, behav, None, versions, 5, 0.0)
    assert first.tolist() == [-1.0, -2.0, -0.5] and not first.requires_grad
    assert obj.proximal_logp("behaviour", lp, behav, None, None, 5, 0.5).tolist() == [-1.5, -2.0, -1.0]
    assert obj.proximal_logp("recompute", lp, behav, t([0.1, 0.2, 0.3]), None, 5, 0.5).tolist() == [0.1, 0.2, 0.3]


def test_behaviour_weight_at_token_and_sequence_level():
    prox = t([9.0, 0.2, -0.6, 5.0, 0.4])      # prox - behav (behav = 0); tokens 0 and 3 are prompt
    behav = t([0.0] * 5)
    tok = obj.behaviour_weight(prox, behav, "token", MASK)
    assert tok[[1, 2, 4]].tolist() == pytest.approx([E ** 0.2, E ** -0.6, E ** 0.4])
    # seq 0: mean of its output tokens' log-weights (0.2 - 0.6) / 2 = -0.2; seq 1: 0.4 / 1
    geo = obj.behaviour_weight(prox, behav, "seq-mean", MASK, SEG, 2)
    assert geo[[1, 2, 4]].tolist() == pytest.approx([E ** -0.2, E ** -0.2, E ** 0.4])
    # products: seq 0: e^(0.2 - 0.6) = e^-0.4; seq 1: e^0.4
    prod = obj.behaviour_weight(prox, behav, "seq-product", MASK, SEG, 2)
    assert prod[[1, 2, 4]].tolist() == pytest.approx([E ** -0.4, E ** -0.4, E ** 0.4])


def test_weight_modes_cap_truncate_and_mask():
    w = t([0.3, 1.0, 2.5, 6.0])
    same, masked = obj.apply_weight_mode(w, "cap-mask", 2.0, 0.5)
    assert same.tolist() == [0.3, 1.0, 2.5, 6.0] and masked.tolist() == [False, False, True, True]
    assert not obj.apply_weight_mode(w, "cap-mask", None, 0.0)[1].any()
    cut, masked = obj.apply_weight_mode(w, "truncate", 2.0, 0.5)     # min(w, 2)
    assert cut.tolist() == [0.3, 1.0, 2.0, 2.0] and not masked.any()
    _, masked = obj.apply_weight_mode(w, "mask", 2.0, 0.5)            # outside [0.5, 2]
    assert masked.tolist() == [True, False, True, True]


def test_sequence_ratio_is_gspos_length_normalised_ratio():
    logp = t([0.0, 0.3, -0.1, 0.0, 0.2], requires_grad=True)
    prox = t([0.0] * 5)
    r = obj.policy_ratio(logp, prox, "sequence", MASK, SEG, 2)
    # seq 0: exp((0.3 - 0.1) / 2) = e^0.1 on every token; seq 1: e^0.2
    assert r.tolist() == pytest.approx([E ** 0.1] * 3 + [E ** 0.2] * 2)
    r[1].backward()
    # d s_0 / d logp_t = s_0 / |y_0| = e^0.1 / 2 for its two output tokens; nothing else
    assert logp.grad.tolist() == pytest.approx([0, E ** 0.1 / 2, E ** 0.1 / 2, 0, 0])


def test_asymmetric_and_dual_clip():
    r = t([1.25, 1.35, 0.7, 5.0, 2.0, 5.0])
    a = t([1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
    o, clip_won, dual_won = obj.clipped_surrogate(r, a, 0.2, 0.28, dual_clip_c=3.0)
    # 1.25 * 1: inside [0.8, 1.28] -> 1.25
    # 1.35 * 1: min(1.35, 1.28) = 1.28 (clipped)
    # 0.7 * -1: min(-0.7, -0.8) = -0.8 (clipped)
    # 5 * -1: min(-5, -1.28) = -5; dual: max(-5, 3 * -1) = -3
    # 2 * -1: min(-2, -1.28) = -2; dual: max(-2, -3) = -2 (dual not active)
    # 5 * 1: min(5, 1.28) = 1.28 (dual clip applies to A < 0 only)
    assert o.tolist() == pytest.approx([1.25, 1.28, -0.8, -3.0, -2.0, 1.28])
    assert clip_won.tolist() == [False, True, True, False, False, True]
    assert dual_won.tolist() == [False, False, False, True, False, False]


def test_aggregations_and_dr_grpo_constant():
    values = t([0.0, 1.0, 2.0, 0.0, 4.0])     # per-token losses; tokens 0 and 3 are prompt
    # The minibatch has N = 10 valid tokens and G = 4 sequences in all (this is one micro-batch).
    def agg(mode, norm=None):
        w = obj.aggregation_weights(mode, MASK, 10, 4, SEG, 2, norm)
        return float(obj.aggregate(values, w, mode, 10))
    assert agg("token-mean") == pytest.approx((1 + 2 + 4) / 10)
    assert agg("seq-mean-token-sum") == pytest.approx((1 + 2 + 4) / 4)
    assert agg("seq-mean-token-sum", norm=8.0) == pytest.approx((1 + 2 + 4) / (4 * 8))
    # ((1 + 2) / 2 + 4 / 1) / 4 = 1.375
    assert agg("seq-mean-token-mean") == pytest.approx(1.375)


@pytest.mark.parametrize("estimator, value, grad", [
    # d = ref - logp = -1.5 - (-1.0) = -0.5
    ("k1", 0.5, 1.0),                                   # -d; d(-d)/dlogp = 1
    ("k2", 0.125, 0.5),                                 # d^2/2; d/dlogp = -d = 0.5
    ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),   # e^d - 1 - d; d/dlogp = 1 - e^d
])
def test_kl_estimators(estimator, value, grad):
    logp = t([-1.0], requires_grad=True)
    k = obj.kl_estimate(logp, t([-1.5]), estimator)
    k.sum().backward()
    assert float(k.detach()) == pytest.approx(value) and float(logp.grad) == pytest.approx(grad)


def test_mismatch_sums_select_tokens():
    trainer, behav = t([-1.0, -2.0, -0.3]), t([-1.0, -2.5, -0.3])
    s = obj.mismatch_sums(trainer, behav, torch.tensor([True, True, False]))
    # rho = e^0 = 1 and e^0.5; k3 = rho - 1 - log rho = 0 and e^0.5 - 1.5
    assert s["mismatch_tokens"] == 2
    assert s["mismatch_k3_sum"] == pytest.approx(E ** 0.5 - 1.5)
    assert s["mismatch_ratio_sum"] == pytest.approx(1 + E ** 0.5)
    assert s["mismatch_ratio_max"] == pytest.approx(E ** 0.5)


def _loss(settings, logp, behav, prox, adv, mask, n_valid, **kw):
    lp = t(logp, requires_grad=True)
    loss, stats = ppo_token_loss(lp, t(behav), None if prox is None else t(prox), t(adv), torch.tensor(mask),
                                 settings, n_valid, **kw)
    loss.backward()
    return float(loss.detach()), lp.grad.tolist(), stats


TIS_CASE = dict(logp=[-1.0, -1.1, -1.3], behav=[-2.0, -1.0, -1.0], prox=[-1.0, -1.2, -1.0],
                adv=[1.0, 1.0, -1.0], mask=[True, True, True], n_valid=3)


def test_truncated_importance_sampling_by_hand():
    s = PPOSettings(0.2, True, 2.0, behav_weight="truncate")
    loss, grad, stats = _loss(s, **TIS_CASE)
    # w = exp(prox - behav) = e^1, e^-0.2, 1 -> truncated at 2: 2, e^-0.2, 1
    # r = exp(logp - prox) = 1, e^0.1, e^-0.3 (= 0.7408)
    # token 0: A=1, r=1 inside the clip: loss -2 * 1 = -2; d/dlogp = -w r A = -2
    # token 1: A=1, r=e^0.1 = 1.105 inside: loss -e^-0.2 e^0.1 = -e^-0.1; d/dlogp = -e^-0.1
    # token 2: A=-1, r=0.7408 < 0.8: min(-0.7408, -0.8) = -0.8 clipped: loss +0.8, no gradient
    assert loss == pytest.approx((-2 - E ** -0.1 + 0.8) / 3)
    assert grad == pytest.approx([-2 / 3, -E ** -0.1 / 3, 0.0])
    assert stats["clipped"] == 1 and stats["capped"] == 0
    assert stats["imp_weight_sum"] == pytest.approx(E + E ** -0.2 + 1)    # raw weights
    assert stats["imp_weight_max"] == pytest.approx(E)


def test_masked_importance_sampling_by_hand():
    s = PPOSettings(0.2, True, 2.0, behav_weight="mask", behav_imp_weight_low=0.5)
    loss, grad, stats = _loss(s, **TIS_CASE)
    # w = e (> 2: masked), e^-0.2 = 0.82 and 1 (inside [0.5, 2]): token 0 drops out of the sum but
    # not out of the count: (-e^-0.1 + 0.8) / 3
    assert loss == pytest.approx((-E ** -0.1 + 0.8) / 3)
    assert grad == pytest.approx([0.0, -E ** -0.1 / 3, 0.0])
    assert stats["capped"] == 1


def test_sample_mask_keeps_the_samples_tokens_in_the_count():
    s = PPOSettings(0.2, True, None)
    loss, grad, stats = _loss(s, **TIS_CASE, sample_mask=torch.tensor([True, False, True]))
    # untruncated w: token 0: -e * 1 = -e; token 1 masked; token 2: +0.8 (clipped, w = 1)
    assert loss == pytest.approx((-E + 0.8) / 3)
    assert grad == pytest.approx([-E / 3, 0.0, 0.0])
    assert stats["sample_masked"] == 1


def test_gspo_sequence_ratio_with_sequence_mean_by_hand():
    s = PPOSettings(0.2, True, None, proximal="behaviour", ratio_level="sequence", loss_agg="seq-mean-token-mean")
    # seq 0 (tokens 1, 2): logp - behav = 0.1, 0.3 -> s_0 = e^0.2 = 1.2214, A = +1
    # seq 1 (token 4): logp - behav = -0.1 -> s_1 = e^-0.1 = 0.9048, A = -1
    loss, grad, _ = _loss(s, logp=[0.0, 0.1, 0.3, 0.0, -0.1], behav=[0.0] * 5, prox=None,
                          adv=[0.0, 1.0, 1.0, 0.0, -1.0], mask=MASK.tolist(), n_valid=3,
                          cu_seqlens=CU, n_seqs=2)
    # seq 0: min(1.2214, 1.2) = 1.2 (clipped, no gradient); seq 1: min(-0.9048, -0.9048): -s_1
    # loss = 1/G * sum_i 1/|y_i| sum_t -obj = 1/2 * (1/2 * (-1.2 - 1.2) + 1/1 * s_1)
    assert loss == pytest.approx(0.5 * (-1.2 + E ** -0.1))
    # d/dlogp_4 = 1/2 * d s_1/dlogp_4 = 1/2 * s_1 / |y_1| = e^-0.1 / 2
    assert grad == pytest.approx([0, 0, 0, 0, E ** -0.1 / 2])


def test_loglinear_first_update_uses_the_current_log_probs():
    s = PPOSettings(0.2, True, None, proximal="loglinear")
    loss, grad, _ = _loss(s, logp=[-1.0], behav=[-1.5], prox=None, adv=[1.0], mask=[True], n_valid=1,
                          versions=torch.tensor([0]), version=1, progress=0.0)
    # prox = logp (detached): w = e^(-1 + 1.5) = e^0.5, r = 1: loss = -e^0.5, d/dlogp = -w r A = -e^0.5
    assert loss == pytest.approx(-E ** 0.5) and grad == pytest.approx([-E ** 0.5])


def test_kl_penalty_and_entropy_bonus_by_hand():
    s = PPOSettings(0.2, True, None, proximal="behaviour", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    ent = t([2.0], requires_grad=True)
    loss, grad, stats = _loss(s, logp=[-1.0], behav=[-1.0], prox=None, adv=[0.0], mask=[True], n_valid=1,
                              ref_logp=t([-1.5]), entropy=ent)
    # A = 0: no policy term. KL k3 with d = -0.5: e^-0.5 - 0.5; times 0.1. Entropy: -0.01 * 2.
    assert loss == pytest.approx(0.1 * (E ** -0.5 - 0.5) - 0.02)
    assert grad == pytest.approx([0.1 * (1 - E ** -0.5)])
    assert float(ent.grad) == pytest.approx(-0.01)
    assert stats["kl_sum"] == pytest.approx(E ** -0.5 - 0.5)


def test_sequence_settings_without_boundaries_are_a_clear_error():
    with pytest.raises(ValueError, match="cu_seqlens"):
        _loss(PPOSettings(ratio_level="sequence"), logp=[-1.0], behav=[-1.0], prox=[-1.0], adv=[1.0],
              mask=[True], n_valid=1)
