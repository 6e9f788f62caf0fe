"""One global step of the loop in-process: eta = 0 equivalence, metrics, staleness accounting
(integration: the loop binds its ZeroMQ trajectory endpoint on a real TCP socket)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.trainer.batch import StepBatch
from tandem.trainer.buffer import Group
from tandem.trainer.config import TrainerConfig
from tandem.trainer.loop import Trainer
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend


def experiment(model_dir, **trainer_kw):
    t = TrainerConfig(temperature=1.0, max_staleness=0, groups_per_step=4, **trainer_kw)
    t.optim.lr = 1e-2
    return SimpleNamespace(trainer=t, experiment=SimpleNamespace(model=str(model_dir), seed=0),
                           gen=SimpleNamespace(num_servers=1))


def on_policy_groups(model_dir, traj, temperature=1.0):
    """Groups whose behaviour log-probs are the initial policy's own (eta = 0, no interruption)."""
    cfg = TrainerConfig(temperature=temperature, max_staleness=0)
    be = TorchBackend(cfg, model_dir, 0)
    groups = []
    for g in range(4):
        samples = []
        for k in range(2):
            t = traj(f"g{g}", k, group_size=2, reward=float((g + k) % 2) * 10 - 5, seed=10 * g + k,
                     out_len=4 + (3 * g + k) % 7, prompt_len=3 + g)
            ids = np.concatenate([t.prompt_ids, t.output_ids])
            lp = be.forward_logprobs(pack([ids]), temperature).logp.numpy()
            t.output_logprobs = lp[len(t.prompt_ids):].astype(np.float32)
            samples.append(t)
        groups.append(Group(f"g{g}", 0, g, samples))
    return groups


def run_step(exp, model_dir, groups, **kw):
    """(metrics, [gradients of each optimizer update, as the optimizer sees them])."""
    trainer = Trainer(experiment(model_dir, **kw), exp)
    grads = []
    opt = trainer.backend.optimizer
    real_step = opt.step

    def recording_step(*a, **k):
        grads.append({n: p.grad.clone() for n, p in trainer.backend.model.named_parameters()})
        return real_step(*a, **k)
    opt.step = recording_step
    try:
        record = trainer.train_step(StepBatch.from_groups(groups))
    finally:
        trainer.close()
    return record, grads


@pytest.mark.parametrize("minibatches", [1, 2])
def test_eta0_decoupled_and_standard_ppo_give_the_same_update(exp, small_model_dir, traj, minibatches):
    groups = on_policy_groups(small_model_dir, traj)
    rec_d, p_dec = run_step(exp, small_model_dir, groups, use_decoupled_loss=True, ppo_n_minibatches=minibatches,
                            max_tokens_per_mb=30)
    rec_s, p_std = run_step(exp, small_model_dir, groups, use_decoupled_loss=False, ppo_n_minibatches=minibatches,
                            max_tokens_per_mb=30)
    assert rec_d["micro_batches"] > minibatches          # the split is exercised
    assert rec_d["imp_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert rec_d["imp_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert len(p_dec) == len(p_std) == minibatches
    for g_dec, g_std in zip(p_dec, p_std, strict=True):
        scale = max(float(g.abs().max()) for g in g_std.values())
        for n in g_dec:
            assert torch.allclose(g_dec[n], g_std[n], rtol=1e-4, atol=1e-5 * scale), n
    assert rec_d["loss"] == pytest.approx(rec_s["loss"], abs=1e-6)


def test_step_metrics_are_complete_and_sane(exp, small_model_dir, traj):
    groups = on_policy_groups(small_model_dir, traj)
    rec, _ = run_step(exp, small_model_dir, groups, behav_imp_weight_cap=1.5)
    for key in ("loss", "clip_fraction", "imp_weight_mean", "imp_weight_max", "masked_fraction", "entropy",
                "grad_norm", "staleness_hist", "tokens_per_s", "prox_s", "train_s"):
        assert key in rec, key
    assert rec["valid_tokens"] == sum(len(t.output_ids) for g in groups for t in g.samples)
    assert rec["masked_fraction"] == 0.0 and rec["clip_fraction"] == 0.0   # first update is on-policy
    assert 0 < rec["entropy"] <= np.log(263) + 1e-6
    assert rec["grad_norm"] > 0 and rec["n_groups"] == 4 and rec["n_seqs"] == 8


def test_behaviour_weight_cap_masks_off_policy_tokens(exp, small_model_dir, traj):
    groups = on_policy_groups(small_model_dir, traj)
    # pretend one sample's first two tokens were sampled by a policy that found them very unlikely
    t = groups[0].samples[0]
    t.output_logprobs = t.output_logprobs.copy()
    t.output_logprobs[:2] -= 3.0      # w = e^3 > cap
    rec, _ = run_step(exp, small_model_dir, groups, behav_imp_weight_cap=5.0)
    assert rec["masked_fraction"] == pytest.approx(2 / rec["valid_tokens"])
    assert rec["imp_weight_max"] == pytest.approx(np.exp(3.0), rel=1e-4)


def test_a_non_finite_loss_stops_the_step_by_name(exp, small_model_dir, traj, caplog):
    """A NaN in the first minibatch's loss (here a behaviour log-prob; the buffer refuses those
    from the wire, so in a run it would be the model's own) stops the step: that update is not
    applied, the second is not run, the log names the term and the step, the record counts it."""
    groups = on_policy_groups(small_model_dir, traj)
    t = groups[0].samples[0]
    t.output_logprobs = t.output_logprobs.copy()
    t.output_logprobs[1] = np.nan
    with caplog.at_level("ERROR", logger="tandem.trainer.loop"):
        rec, grads = run_step(exp, small_model_dir, groups, ppo_n_minibatches=2)
    assert grads == []                                   # the optimizer never stepped
    assert rec["nonfinite_loss"] == {"policy": 1} and rec["updates_not_run"] == 1
    assert rec["updates_skipped"] == 1 and rec["nonfinite_steps_total"] == 1
    assert any("step 0: loss term policy" in r.getMessage() for r in caplog.records), caplog.text
