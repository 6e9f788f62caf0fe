"""Property: every objective the config check accepts, and its gradient, stays finite over
random inputs with extreme log-probs (+-50, -1e4: a token the policy all but rules out, a
generator returning garbage). Two parts: the whole grid of settings on one seeded extreme batch
(every combination is covered), and hypothesis over random batches and random settings.
Before the bounds (issue 36) a log-ratio of 1e4 overflowed exp to inf, and a masked token's inf
turned the gradient into NaN (0 * inf) even where the loss itself was finite."""
from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.trainer.config import TrainerConfig
from tandem.trainer.loss import ppo_token_loss
from tandem.trainer.objective_step import settings_from_config

EXTREMES = (-1e4, -50.0, 50.0, 0.0, -1e-6)


def accepted_configs() -> list[TrainerConfig]:
    """Every combination of the objective's switches that the config check accepts."""
    out = []
    grid = itertools.product(
        ("recompute", "loglinear", "behaviour"), ("cap-mask", "truncate", "mask"),
        ("token", "seq-mean", "seq-product"), (None, 2.0), ("token", "sequence"),
        ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"), ("off", "k1", "k2", "k3"),
        (None, 3.0))
    for prox, mode, level, cap, ratio, agg, kl, dual in grid:
        t = TrainerConfig(temperature=1.0, max_staleness=0, proximal=prox, behav_weight=mode,
                          behav_weight_level=level, behav_imp_weight_cap=cap, ratio_level=ratio, loss_agg=agg,
                          loss_agg_norm=64.0 if agg == "seq-mean-token-sum" else None,
                          kl_coef=0.0 if kl == "off" else 0.04, kl_estimator="k3" if kl == "off" else kl,
                          dual_clip_c=dual, entropy_coef=0.01 if dual else 0.0,
                          behav_imp_weight_low=0.5 if mode == "mask" else 0.0)
        if not t.problems():
            out.append(t)
    return out


CONFIGS = accepted_configs()


def batch(gen: torch.Generator, lens: list[int], pick_extreme: float = 0.3) -> dict:
    """A packed micro-batch whose log-probs are drawn from [-50, 0] with extremes mixed in."""
    n = sum(lens)

    def logprobs():
        base = -50.0 * torch.rand(n, generator=gen)
        ext = torch.tensor(EXTREMES)[torch.randint(len(EXTREMES), (n,), generator=gen)]
        return torch.where(torch.rand(n, generator=gen) < pick_extreme, ext, base)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    mask = torch.rand(n, generator=gen) < 0.85
    mask[cu[:-1].long()] = False          # a sequence's first token is its prompt
    return {"logp": logprobs(), "behav": logprobs(), "prox": logprobs(), "ref": logprobs(),
            "adv": 10 * torch.randn(n, generator=gen), "entropy": 5 * torch.rand(n, generator=gen),
            "versions": torch.randint(0, 4, (n,), generator=gen), "cu": cu, "mask": mask}


def loss_and_grad(t: TrainerConfig, b: dict, dtype=torch.float32):
    logp = b["logp"].to(dtype).requires_grad_()
    entropy = b["entropy"].to(dtype).requires_grad_()
    s = settings_from_config(t)
    loss, stats = ppo_token_loss(
        logp, b["behav"].to(dtype), b["prox"].to(dtype), b["adv"].to(dtype), b["mask"], s,
        float(b["mask"].sum()), cu_seqlens=b["cu"], n_seqs=len(b["cu"]) - 1, versions=b["versions"], version=4,
        progress=0.5, ref_logp=b["ref"].to(dtype), entropy=entropy if s.entropy_coef else None)
    loss.backward()
    return loss.detach(), logp.grad, entropy.grad, stats


def assert_finite(t, loss, grad, ent_grad, stats):
    where = (t.proximal, t.behav_weight, t.behav_weight_level, t.behav_imp_weight_cap, t.ratio_level,
             t.loss_agg, t.kl_coef and t.kl_estimator, t.dual_clip_c)
    assert torch.isfinite(loss), where
    assert torch.isfinite(grad).all(), where
    assert ent_grad is None or torch.isfinite(ent_grad).all(), where
    assert all(v == 0.0 for k, v in stats.items() if k.startswith("nonfinite_")), where
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()), where


def test_the_grid_covers_every_switch():
    assert len(CONFIGS) > 400
    for key in ("proximal", "behav_weight", "behav_weight_level", "ratio_level", "loss_agg", "kl_estimator"):
        assert len({getattr(t, key) for t in CONFIGS}) > 1, key


def test_every_accepted_objective_is_finite_on_an_extreme_batch():
    gen = torch.Generator().manual_seed(36)
    b = batch(gen, [1, 7, 40, 3, 12], pick_extreme=0.5)
    # the batch holds every extreme, both in and out of the loss mask
    for value in (-1e4, 50.0):
        assert ((b["logp"] == value) & b["mask"]).any() and ((b["behav"] == value) & b["mask"]).any()
    for t in CONFIGS:
        assert_finite(t, *loss_and_grad(t, b))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(1, 60), min_size=1, max_size=6),
       pick=st.floats(0.0, 1.0), which=st.integers(0, len(CONFIGS) - 1))
def test_random_extreme_inputs_give_a_finite_objective_and_gradient(seed, lens, pick, which):
    t = CONFIGS[which]
    b = batch(torch.Generator().manual_seed(seed), lens, pick)
    assert_finite(t, *loss_and_grad(t, b))
