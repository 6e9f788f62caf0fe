"""Every `trainer.algorithm` preset trains: the real loop's train_step in-process (as
test_trainer_step.py; integration because the loop binds its trajectory socket), two steps per
preset, the second on tokens of two policy versions, each step record carrying the mismatch
metrics. A full `tandem run` of a non-default preset is tests/integration/e2e/test_preset_run.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tandem.launcher.config import load_config
from tandem.services.protocol import ExpDir, generate_keys
from tandem.trainer.batch import StepBatch
from tandem.trainer.buffer import Group
from tandem.trainer.loop import Trainer
from tandem.trainer.microbatch import pack
from tandem.trainer.presets import PRESETS
from tandem.trainer.torch_backend import TorchBackend

MISMATCH = ("mismatch_k3", "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_tokens", "mismatch_source")


@pytest.fixture(scope="module")
def step_batches(small_model_dir, traj):
    """Two steps of 4 groups x 2 samples: behaviour log-probs = the initial model's + noise (sd 0.1);
    step 2's samples carry tokens of version 0 (first half) and 1 (second half); one sample per
    step stopped at the length limit."""
    from tandem.trainer.config import TrainerConfig
    be = TorchBackend(TrainerConfig(temperature=1.0, max_staleness=1), small_model_dir, 0)
    rng = np.random.default_rng(0)
    out = []
    for step in range(2):
        groups = []
        for g in range(4):
            samples = []
            for k in range(2):
                n = 4 + (3 * g + k) % 7
                versions = [0] * n if step == 0 else [0] * (n // 2) + [1] * (n - n // 2)
                t = traj(f"s{step}g{g}", k, reward=float((g + k + step) % 2) * 10 - 5,
                                    seed=100 * step + 10 * g + k, out_len=n, prompt_len=3 + g, versions=versions)
                lp = be.forward_logprobs(pack([np.concatenate([t.prompt_ids, t.output_ids])]), 1.0).logp.numpy()
                own = lp[len(t.prompt_ids):]
                t.output_logprobs = (own + rng.normal(0, 0.1, n)).astype(np.float32)
                t.finish_reason = "length" if (g, k) == (1, 0) else "stop"
                samples.append(t)
            groups.append(Group(f"s{step}g{g}", 0, g, samples))
        out.append(StepBatch.from_groups(groups))
    return out


def run_two_steps(tmp_path, model_dir, batches, *overrides):
    exp = ExpDir(tmp_path / "exp")
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    cfg = load_config(None, ["experiment.name=preset", f"experiment.model={model_dir}",
                             f"experiment.exp_dir={exp.root}", "trainer.groups_per_step=4",
                             "controller.max_staleness=1", "trainer.ppo_n_minibatches=2",
                             "trainer.max_tokens_per_mb=30", "trainer.optim.lr=0.01", "rollout.max_new_tokens=10",
                             "rollout.max_prompt_tokens=20",
                             *overrides])
    trainer = Trainer(cfg, exp)
    calls = []
    real = trainer.backend.forward_logprobs
    trainer.backend.forward_logprobs = lambda *a, **k: calls.append(1) or real(*a, **k)
    before = {n: p.detach().clone() for n, p in trainer.backend.model.named_parameters()}
    records = []
    try:
        for batch in batches:
            records.append(trainer.train_step(batch))
            trainer.version += 1
        after = {n: p.detach().clone() for n, p in trainer.backend.model.named_parameters()}
    finally:
        trainer.close()
    changed = any(not torch.equal(before[n], after[n]) for n in before)
    return cfg, records, len(calls), changed, after


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_and_logs_the_mismatch(tmp_path, small_model_dir, step_batches, name):
    cfg, records, prox_forwards, changed, _ = run_two_steps(tmp_path, small_model_dir, step_batches,
                                                             f"trainer.algorithm={name}")
    t = cfg.trainer
    assert changed
    # the proximal forward runs only for proximal: recompute (one per micro-batch)
    recompute = t.proximal == "recompute"
    assert (prox_forwards > 0) == recompute, prox_forwards
    for step, rec in enumerate(records):
        for key in MISMATCH:
            assert key in rec, (name, key)
        assert math.isfinite(rec["loss"]) and math.isfinite(rec["objective"]) and rec["grad_norm"] > 0
        assert rec["mismatch_source"] == ("proximal" if recompute else "first_update")
        # tokens of the version trained only: all of step 1's, the second halves of step 2's
        # samples; of the first minibatch only when the proximal pass is skipped
        at_version = sum(int((v == step).sum()) for v in step_batches[step].versions)
        assert at_version < rec["valid_tokens"] or step == 0
        if recompute:
            assert rec["mismatch_tokens"] == at_version
        else:
            assert 0 < rec["mismatch_tokens"] < at_version
        # behaviour = initial policy + noise of sd 0.1: k3 ~ sd^2 / 2 at step 1
        assert 0 <= rec["mismatch_k3"] < (0.02 if step == 0 else 1.0)
        assert rec["mismatch_ratio_max"] >= rec["mismatch_ratio_mean"] > 0
        assert "dynamic_filtered_groups" not in rec   # the collect phase's (not run here)
        assert rec["truncated_samples"] == 1
    if t.kl_coef:
        assert records[1]["kl"] > 0           # the policy moved away from the initial one
    if t.mask_truncated:
        assert all(r["sample_masked_fraction"] > 0 for r in records)
    if t.overlong_buffer:
        # dapo: buffer 10 // 5 = 2; the 10-token outputs (> 10 - 2) of both steps are penalised
        assert all(r["overlong_penalty_mean"] < 0 for r in records)


def test_loglinear_saves_the_proximal_forward_and_is_exact_in_a_first_update(tmp_path, small_model_dir,
                                                                              step_batches):
    """With one minibatch the only update runs with the step's start parameters, where
    loglinear's proximal log-probs are the current ones: the same update as recompute."""
    one = ("trainer.ppo_n_minibatches=1", "trainer.max_tokens_per_mb=1000")
    _, rec_r, n_r, _, w_r = run_two_steps(tmp_path / "r", small_model_dir, step_batches[:1], *one)
    _, rec_l, n_l, _, w_l = run_two_steps(tmp_path / "l", small_model_dir, step_batches[:1], *one,
                                          "trainer.proximal=loglinear")
    assert n_r == 1 and n_l == 0
    for n in w_r:
        assert torch.allclose(w_r[n], w_l[n], rtol=1e-5, atol=1e-7), n
    assert rec_l[0]["mismatch_k3"] == pytest.approx(rec_r[0]["mismatch_k3"], rel=1e-4)
    # and with two minibatches, loglinear trains without a proximal forward
    _, recs, n, changed, _ = run_two_steps(tmp_path / "l2", small_model_dir, step_batches,
                                           "trainer.proximal=loglinear")
    assert n == 0 and changed and all(math.isfinite(r["loss"]) for r in recs)
