"""The PPO objective against independent references (hand cases and a float64 per-token loop)."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.trainer.loss import PPOSettings, ppo_token_loss


def reference_loss_and_grad(logp, behav, prox, adv, mask, eps, cap, decoupled):
    """Naive per-token float64 loss and d loss / d logp, written from the formula alone."""
    n_valid = sum(1 for m in mask if m)
    total, grad = 0.0, []
    for lp, b, p, a, m in zip(logp, behav, prox, adv, mask, strict=True):
        if not m:
            grad.append(0.0)
            continue
        base = p if decoupled else b
        w = math.exp(p - b) if decoupled else 1.0
        if decoupled and cap is not None and w > cap:
            grad.append(0.0)
            continue
        r = math.exp(lp - base)
        r_clip = min(max(r, 1 - eps), 1 + eps)
        if r * a <= r_clip * a:   # unclipped branch is the min: d(r*a)/dlogp = r*a
            total += -w * r * a
            grad.append(-w * r * a / n_valid)
        else:                     # clipped branch: constant in logp
            total += -w * r_clip * a
            grad.append(0.0)
    return total / n_valid, grad


def _run(logp, behav, prox, adv, mask, settings, dtype=torch.float64):
    lp = torch.tensor(logp, dtype=dtype, requires_grad=True)
    loss, stats = ppo_token_loss(lp, torch.tensor(behav, dtype=dtype),
                                 None if prox is None else torch.tensor(prox, dtype=dtype),
                                 torch.tensor(adv, dtype=dtype), torch.tensor(mask), settings,
                                 n_valid=sum(mask))
    loss.backward()
    return loss.detach(), lp.grad, stats


def test_decoupled_equals_standard_ppo_when_proximal_is_behaviour():
    g = torch.Generator().manual_seed(0)
    behav = (-torch.rand(50, generator=g, dtype=torch.float64) * 3).tolist()
    logp = [b + 0.3 * float(x) for b, x in zip(behav, torch.randn(50, generator=g, dtype=torch.float64), strict=True)]
    adv = torch.randn(50, generator=g, dtype=torch.float64).tolist()
    mask = [i % 7 != 0 for i in range(50)]
    l_dec, g_dec, s_dec = _run(logp, behav, behav, adv, mask, PPOSettings(0.2, True, None))
    l_std, g_std, s_std = _run(logp, behav, None, adv, mask, PPOSettings(0.2, False, None))
    assert torch.equal(l_dec, l_std)
    assert torch.equal(g_dec, g_std)
    assert s_dec["clipped"] == s_std["clipped"] > 0   # the case exercises clipping


@pytest.mark.parametrize("adv, ratio, clipped", [
    (1.0, 1.5, True),     # A > 0, r above 1 + eps: clipped, no gradient
    (1.0, 0.5, False),    # A > 0, r below 1 - eps: unclipped (pessimistic branch)
    (-1.0, 0.5, True),    # A < 0, r below 1 - eps: clipped
    (-1.0, 1.5, False),   # A < 0, r above 1 + eps: unclipped
    (1.0, 1.1, False),    # inside the trust region
    (-2.0, 0.9, False),
])
def test_clip_regions(adv, ratio, clipped):
    eps = 0.2
    behav = [-1.0]
    logp = [-1.0 + math.log(ratio)]
    loss, grad, stats = _run(logp, behav, None, [adv], [True], PPOSettings(eps, False, None))
    expect = -min(ratio * adv, min(max(ratio, 1 - eps), 1 + eps) * adv)
    assert float(loss) == pytest.approx(expect, rel=1e-12)
    assert stats["clipped"] == float(clipped)
    if clipped:
        assert float(grad[0]) == 0.0
    else:
        assert float(grad[0]) == pytest.approx(-ratio * adv, rel=1e-12)


def test_cap_masks_exactly_the_tokens_above_it():
    behav = [-1.0, -1.0, -1.0, -1.0, -2.0]
    # importance weights exp(prox - behav): 1, e^0.5, e^1.5 (> cap 3), e^2 (> cap), padding
    prox = [-1.0, -0.5, 0.5, 1.0, -2.0]
    logp = [p + 0.05 for p in prox]
    adv = [1.0, -1.0, 1.0, 1.0, 1.0]
    mask = [True, True, True, True, False]
    settings = PPOSettings(0.2, True, 3.0)
    loss, grad, stats = _run(logp, behav, prox, adv, mask, settings)
    ref_loss, ref_grad = reference_loss_and_grad(logp, behav, prox, adv, mask, 0.2, 3.0, True)
    assert stats["capped"] == 2.0
    assert grad[2] == 0.0 and grad[3] == 0.0 and grad[4] == 0.0
    assert grad[0] != 0.0 and grad[1] != 0.0
    assert float(loss) == pytest.approx(ref_loss, rel=1e-12)
    # the masked tokens still count in the average: 4 valid tokens, not 2
    w1 = math.exp(0.5)
    manual = (-(1.0 * math.exp(0.05) * 1.0) - (w1 * math.exp(0.05) * -1.0)) / 4
    assert float(loss) == pytest.approx(manual, rel=1e-12)
    assert stats["imp_weight_max"] == pytest.approx(math.exp(2.0))


@pytest.mark.parametrize("decoupled, cap", [(True, None), (True, 2.0), (False, None)])
def test_gradient_matches_float64_per_token_reference(decoupled, cap):
    g = torch.Generator().manual_seed(1)
    n = 200
    behav = (-torch.rand(n, generator=g, dtype=torch.float64) * 4).tolist()
    prox = [b + 0.4 * float(x) for b, x in zip(behav, torch.randn(n, generator=g, dtype=torch.float64), strict=True)]
    logp = [p + 0.3 * float(x) for p, x in zip(prox, torch.randn(n, generator=g, dtype=torch.float64), strict=True)]
    adv = torch.randn(n, generator=g, dtype=torch.float64).tolist()
    mask = [bool(x) for x in (torch.rand(n, generator=g) > 0.2)]
    settings = PPOSettings(0.2, decoupled, cap)
    loss, grad, _ = _run(logp, behav, prox if decoupled else None, adv, mask, settings)
    ref_loss, ref_grad = reference_loss_and_grad(logp, behav, prox, adv, mask, 0.2, cap, decoupled)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-10)
    assert torch.allclose(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-10, atol=1e-14)
    # float32 inputs give the same answer to float32 precision
    loss32, grad32, _ = _run(logp, behav, prox if decoupled else None, adv, mask, settings, torch.float32)
    assert torch.allclose(grad32.double(), grad, rtol=1e-4, atol=1e-7)


def test_decoupled_without_proximal_is_a_clear_error():
    with pytest.raises(ValueError, match="prox_logp"):
        _run([-1.0], [-1.0], None, [1.0], [True], PPOSettings(0.2, True, None))
