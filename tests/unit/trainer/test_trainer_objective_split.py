"""Splitting a minibatch into micro-batches never changes the gradient, for every aggregation
and every sequence-level setting: the loop's own loss function (objective_step.make_loss_fn)
on the real torch backend, one micro-batch against three or more."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.trainer import objective_step
from tandem.trainer.batch import Shaping, StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import TrainerConfig
from tandem.trainer.loss import PPOSettings
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend


def _batch(traj, backend):
    """4 groups of 2; behaviour log-probs = the model's own + noise (sd 0.3), so the weights vary
    around 1 and caps, masks and truncation all bite somewhere."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(4):
        samples = [traj(f"g{g}", k, group_size=2, reward=float((g + k) % 2) * 10 - 5, seed=10 * g + k,
                        out_len=3 + (g * 5 + k) % 9, prompt_len=2 + g) for k in range(2)]
        for s in samples:
            lp = backend.forward_logprobs(pack([np.concatenate([s.prompt_ids, s.output_ids])]), 1.0).logp.numpy()
            own = lp[len(s.prompt_ids):]
            s.output_logprobs = (own + rng.normal(0, 0.3, len(own))).astype(np.float32)
        samples[0].finish_reason = "length" if g == 1 else "stop"
        groups.append(Group(f"g{g}", 0, g, samples))
    return StepBatch.from_groups(groups)


CASES = {
    "token-mean": PPOSettings(0.2, True, 1.3),
    "seq-mean-token-sum": PPOSettings(0.2, True, None, loss_agg="seq-mean-token-sum"),
    "dr-grpo-constant": PPOSettings(0.2, False, None, loss_agg="seq-mean-token-sum", loss_agg_norm=16.0),
    "seq-mean-token-mean": PPOSettings(0.2, True, None, loss_agg="seq-mean-token-mean"),
    "gspo": PPOSettings(0.2, True, None, proximal="behaviour", ratio_level="sequence", eps_clip_low=3e-4,
                        eps_clip_high=4e-4, loss_agg="seq-mean-token-mean"),
    "seq-weights-kl-entropy": PPOSettings(0.2, True, 2.0, behav_weight="truncate", behav_weight_level="seq-mean",
                                          dual_clip_c=3.0, eps_clip_high=0.28, kl_coef=0.05, entropy_coef=0.01,
                                          loss_agg="seq-mean-token-mean"),
    "seq-product-mask": PPOSettings(0.2, True, 2.0, behav_weight="mask", behav_imp_weight_low=0.5,
                                    behav_weight_level="seq-product", loss_agg="token-mean"),
}


@pytest.fixture(scope="module")
def backend(small_model_dir):
    t = TrainerConfig(temperature=1.0, max_staleness=0)
    t.optim.lr = 1e-2
    return TorchBackend(t, small_model_dir, 0)


def _grads(backend, mp, settings):
    captured = {}
    real_step = backend.optimizer.step
    backend.optimizer.step = lambda *a, **k: captured.update(
        {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None})
    backend.entropy_grad = settings.entropy_coef > 0
    try:
        res = backend.train_step(mp.micro_batches, objective_step.make_loss_fn(settings, mp, 0, 1, 0), 1.0)
    finally:
        backend.optimizer.step = real_step
        backend.entropy_grad = False
    return captured, res.stats


@pytest.mark.parametrize("name", list(CASES))
def test_one_or_many_micro_batches_give_the_same_gradient(backend, traj, name):
    settings = CASES[name]
    batch = _batch(traj, backend)
    plans = []
    for max_tokens in (10_000, 24):
        plan = plan_step(batch, 1, max_tokens, 1, 0, True, True, Shaping(mask_truncated=True))
        objective_step.start_of_step(plan, backend, 1.0, settings)
        plans.append(plan.minibatches[0])
    one, many = plans
    assert len(one.micro_batches) == 1 and len(many.micro_batches) >= 3
    assert one.n_seqs == many.n_seqs == 8 and one.n_valid == many.n_valid
    g1, s1 = _grads(backend, one, settings)
    g2, s2 = _grads(backend, many, settings)
    assert g1.keys() == g2.keys() and g1
    scale = max(float(g.abs().max()) for g in g1.values())
    assert scale > 0
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6 * scale), n
    assert s1["objective"] == pytest.approx(s2["objective"], rel=1e-5, abs=1e-7)
    assert s1["sample_masked"] == s2["sample_masked"] > 0      # the truncated sample is masked
    if settings.behav_weight != "truncate":                     # the cap / mask bites, not everywhere
        assert s1["capped"] == s2["capped"] and (settings.behav_imp_weight_cap is None or
                                                 0 < s1["capped"] < one.n_valid), s1["capped"]
    # version 0 tokens, start-of-step log-probs: the mismatch is measured on every token
    assert s1["mismatch_tokens"] == s2["mismatch_tokens"] == one.n_valid
