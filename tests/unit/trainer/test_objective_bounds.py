"""The objective's bounds (issue 36): every exp takes a clamped log-ratio, the KL estimate is
clamped, and a NaN/inf loss term stops the update by name instead of being skipped silently.
Numbers are worked out in the comments, not by calling the code under test; the cases are the
issue's own (a k3 term of ~1.8e7 at kl_coef 0.04, a sequence product of e^60)."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.trainer import objectives as obj
from tandem.trainer.backend import StepResult, agreed_nonfinite
from tandem.trainer.config import TrainerConfig
from tandem.trainer.loss import LOSS_TERMS, PPOSettings, ppo_token_loss
from tandem.trainer.objective_step import NonFiniteStop, nonfinite_fields, settings_from_config
from tandem.trainer.presets import PRESETS


def preset_settings(name: str) -> PPOSettings:
    """PPOSettings of a preset as the launcher resolves it (rollout.max_new_tokens 64, rewards +-5)."""
    values = {"rollout.max_new_tokens": 64, "reward.correct_reward": 5.0, "reward.wrong_reward": -5.0,
              "trainer.proximal": PRESETS[name]["trainer.proximal"], "trainer.use_decoupled_loss": True}
    t = TrainerConfig(overlong_max_len=64, temperature=1.0, max_staleness=0)
    for key, value in PRESETS[name].items():
        section, field = key.split(".", 1)
        if section == "trainer":
            setattr(t, field, value(values.get) if callable(value) else value)
    assert t.problems() == []
    return settings_from_config(t)


# ---- the k3 KL: the grpo preset's penalty ---------------------------------------------------------
def test_k3_of_a_token_the_policy_all_but_rules_out_is_bounded():
    # logp = -20, ref = -0.05: d = 19.95, unclamped k3 = e^19.95 - 20.95 ~ 4.6e8; times kl_coef 0.04
    # ~ 1.8e7, and the gradient -(e^d - 1) * 0.04 as large. verl and AReaL clamp the estimate to 10.
    logp = torch.tensor([-20.0], requires_grad=True)
    k = obj.kl_estimate(logp, torch.tensor([-0.05]), "k3")
    assert float(k.detach()) == 10.0
    k.sum().backward()
    assert float(logp.grad) == 0.0          # beyond the clamp: no gradient (as in both sources)
    # inside the bounds nothing changes: d = 0.5 gives e^0.5 - 1.5, gradient -(e^0.5 - 1)
    lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    k = obj.kl_estimate(lp, torch.tensor([-0.5], dtype=torch.float64), "k3")
    k.backward()
    assert float(k.detach()) == pytest.approx(math.exp(0.5) - 1.5, abs=1e-15)
    assert float(lp.grad) == pytest.approx(-(math.exp(0.5) - 1), abs=1e-15)


def test_the_grpo_preset_penalty_is_at_most_kl_coef_times_the_clamp():
    s = preset_settings("grpo")
    assert (s.kl_coef, s.kl_estimator, s.kl_clamp, s.log_ratio_clamp) == (0.04, "k3", 10.0, 20.0)
    mask = torch.tensor([False, True, True])
    logp = torch.tensor([0.0, -20.0, -0.1], requires_grad=True)
    behav = logp.detach().clone()
    ref = torch.tensor([0.0, -0.05, -0.1])
    loss, stats = ppo_token_loss(logp, behav, None, torch.zeros(3), mask, s, 2.0,
                                 cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), n_seqs=1, ref_logp=ref)
    loss.backward()
    # A = 0: only the KL; seq-mean-token-mean over one sequence of 2 tokens: 0.04 * (10 + 0) / 2
    assert float(loss.detach()) == pytest.approx(0.04 * 10 / 2)
    assert torch.isfinite(logp.grad).all() and float(logp.grad.abs().max()) == 0.0
    assert stats["kl_sum"] == pytest.approx(10.0)


def test_k1_and_k2_are_clamped_as_areal_clamps_them():
    logp, ref = torch.tensor([-1e4, -1.0]), torch.tensor([-1.0, -1e4])
    assert obj.kl_estimate(logp, ref, "k1").tolist() == [-10.0, 10.0]   # logp - ref = -+9999, clamped
    assert obj.kl_estimate(logp, ref, "k2").tolist() == [10.0, 10.0]    # 9999^2 / 2, clamped
    assert obj.kl_estimate(logp, ref, "k3", kl_bound=3.0).tolist() == [3.0, 3.0]


# ---- importance weights and ratios -----------------------------------------------------------------
def test_sequence_product_weight_is_bounded_in_log_space():
    # 100 output tokens at log-ratio 0.6: the product is e^60 ~ 1.1e26 unclamped; 200 tokens:
    # e^120, inf in float32. Computed in log space and clamped at 20: e^20 for both.
    for n in (100, 200):
        mask = torch.ones(n, dtype=torch.bool)
        seg = torch.zeros(n, dtype=torch.long)
        w = obj.behaviour_weight(torch.full((n,), 0.6), torch.zeros(n), "seq-product", mask, seg, 1)
        assert torch.isfinite(w).all()
        assert float(w[0]) == pytest.approx(math.exp(20.0), rel=1e-6)
    # below the bound the product is exact: 10 tokens at 0.6 -> e^6
    w = obj.behaviour_weight(torch.full((10,), 0.6, dtype=torch.float64), torch.zeros(10, dtype=torch.float64),
                             "seq-product", torch.ones(10, dtype=torch.bool), torch.zeros(10, dtype=torch.long), 1)
    assert float(w[0]) == pytest.approx(math.exp(6.0), rel=1e-12)


def test_token_weight_and_ratios_take_clamped_exponents():
    mask = torch.ones(3, dtype=torch.bool)
    # token weight: log-weights 50, -50, 1 -> e^20, e^-20, e^1 (bound 20)
    w = obj.behaviour_weight(torch.tensor([50.0, -50.0, 1.0]), torch.zeros(3), "token", mask)
    assert w.tolist() == pytest.approx([math.exp(20), math.exp(-20), math.e], rel=1e-6)
    # policy ratio, token: logp - prox = 1e4 (a -1e4 proximal log-prob) -> e^20 with zero gradient
    logp = torch.tensor([0.0, -0.5, -2.0], requires_grad=True)
    r = obj.policy_ratio(logp, torch.tensor([-1e4, -0.5, -1.0]), "token", mask)
    r.sum().backward()
    assert r.tolist() == pytest.approx([math.exp(20), 1.0, math.exp(-1)], rel=1e-6)
    assert logp.grad.tolist() == pytest.approx([0.0, 1.0, math.exp(-1)], rel=1e-6)
    # sequence ratio: mean log-ratio (30 + 40) / 2 = 35 -> e^20 with a bound of 20; e^5 with 5
    seg = torch.zeros(2, dtype=torch.long)
    two = torch.ones(2, dtype=torch.bool)
    r = obj.policy_ratio(torch.tensor([30.0, 40.0]), torch.zeros(2), "sequence", two, seg, 1)
    assert r.tolist() == pytest.approx([math.exp(20)] * 2, rel=1e-6)
    r = obj.policy_ratio(torch.tensor([30.0, 40.0]), torch.zeros(2), "sequence", two, seg, 1, bound=5.0)
    assert r.tolist() == pytest.approx([math.exp(5)] * 2, rel=1e-6)


def test_mismatch_metrics_stay_finite_for_a_garbage_generator_log_prob():
    # log rho = -1 - (-1e4) = 9999 -> clamped to 20: rho = e^20, k3 = e^20 - 1 - 20
    m = obj.mismatch_sums(torch.tensor([-1.0]), torch.tensor([-1e4]), torch.tensor([True]))
    assert m["mismatch_ratio_max"] == pytest.approx(math.exp(20))
    assert m["mismatch_k3_sum"] == pytest.approx(math.exp(20) - 21)


def test_cap_masking_at_the_bound_is_unchanged_inside_it():
    # cap 5 (the areal preset): a token at log-weight 1.7 (w = 5.47) is masked, one at 1.5 kept
    s = PPOSettings(behav_imp_weight_cap=5.0)
    mask = torch.ones(2, dtype=torch.bool)
    logp = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    prox = logp.detach().clone()
    behav = prox - torch.tensor([1.7, 1.5], dtype=torch.float64)
    loss, stats = ppo_token_loss(logp, behav, prox, torch.tensor([1.0, 1.0], dtype=torch.float64), mask, s, 2.0)
    # kept token: r = 1, obj = A = 1, loss = -e^1.5 * 1 / 2 (the masked token still counts in N = 2)
    assert float(loss.detach()) == pytest.approx(-math.exp(1.5) / 2, rel=1e-12)
    assert stats["capped"] == 1.0


# ---- NaN / inf: named, counted, and the update refused ---------------------------------------------
def _one_seq(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("term", LOSS_TERMS)
def test_a_non_finite_term_is_reported_by_name(term):
    s = PPOSettings(kl_coef=0.1, entropy_coef=0.01)
    mask = torch.tensor([True, True])
    logp = _one_seq([-1.0, -2.0]).requires_grad_()
    behav, ref, ent = _one_seq([-1.0, -2.0]), _one_seq([-1.0, -2.0]), _one_seq([0.5, 0.5])
    adv = _one_seq([1.0, -1.0])
    if term == "policy":
        adv = _one_seq([math.nan, -1.0])       # an advantage the shaping let through
    elif term == "kl":
        ref = _one_seq([math.nan, -2.0])       # the reference model's forward diverged
    else:
        ent = _one_seq([math.inf, 0.5])
    _, stats = ppo_token_loss(logp, behav, behav, adv, mask, s, 2.0, ref_logp=ref, entropy=ent)
    assert {t: stats[f"nonfinite_{t}"] for t in LOSS_TERMS} == {t: float(t == term) for t in LOSS_TERMS}


def test_finite_inputs_report_no_non_finite_term():
    _, stats = ppo_token_loss(_one_seq([-1e4, -50.0]).requires_grad_(), _one_seq([50.0, -1e4]), None,
                              _one_seq([3.0, -3.0]), torch.tensor([True, True]), PPOSettings(proximal="behaviour"),
                              2.0)
    assert all(stats[f"nonfinite_{t}"] == 0.0 for t in LOSS_TERMS)


def test_agreed_nonfinite_names_the_terms_and_counts_micro_batches():
    stats = {"nonfinite_policy": 0.0, "nonfinite_kl": 2.0, "nonfinite_entropy": 0.0, "loss": 1.0}
    assert agreed_nonfinite(stats) == {"kl": 2}
    assert agreed_nonfinite({}) == {}        # a pipeline stage without the loss: no terms
    assert StepResult(grad_norm=0.0, lr=0.0).nonfinite == {}


def test_the_stop_message_names_the_term_and_the_step():
    stop = NonFiniteStop(version=7, update=0, n=3, terms={"kl": 1})
    text = str(stop)
    assert "step 7" in text and "kl" in text and "update 1 of 3" in text and "2 later update(s) not run" in text
    assert nonfinite_fields(stop, 4) == {"nonfinite_loss": {"kl": 1}, "updates_not_run": 2,
                                         "nonfinite_steps_total": 4}
    assert nonfinite_fields(None, 0) == {"nonfinite_loss": {}, "updates_not_run": 0, "nonfinite_steps_total": 0}


def test_torch_backend_refuses_the_update_when_a_term_is_not_finite(small_model_dir, traj):
    from tandem.trainer import build_backend
    from tandem.trainer.batch import StepBatch, plan_step
    from tandem.trainer.buffer import Group

    t = TrainerConfig(temperature=1.0, max_staleness=0)
    t.optim.lr = 1e-2
    be = build_backend(t, small_model_dir, 0)
    groups = [Group(f"g{g}", 0, g, [traj(f"g{g}", k, group_size=2, reward=float(k), seed=g * 2 + k)
                                     for k in range(2)]) for g in range(2)]
    mp = plan_step(StepBatch.from_groups(groups), 1, 10_000, 1, 0, True, True).minibatches[0]
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    settings = PPOSettings(proximal="behaviour")

    def loss_fn(mb, out):
        f = mb.fields
        adv = f["advantages"].clone()
        adv[f["loss_mask"].bool().nonzero()[0]] = math.nan
        return ppo_token_loss(out.logp, f["behav_logp"], None, adv, f["loss_mask"], settings, mp.n_valid)
    res = be.train_step(mp.micro_batches, loss_fn, 1.0)
    assert not res.applied and res.nonfinite == {"policy": len(mp.micro_batches)}
    assert all(torch.equal(before[n], p) for n, p in be.model.named_parameters())
    assert all(not s for s in be.optimizer.state.values())       # Adam never stepped
