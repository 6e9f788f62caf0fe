"""The torch backend: log-prob convention, packed == per-sequence, split invariance, export."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.trainer import build_backend
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import TrainerConfig
from tandem.trainer.loss import PPOSettings, ppo_token_loss
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend


def cfg(**kw) -> TrainerConfig:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_staleness", 0)
    c = TrainerConfig(**kw)
    c.optim.lr = 1e-2
    return c


def seqs(n=5, seed=0, vocab=200):
    rng = np.random.default_rng(seed)
    return [rng.integers(7, vocab, int(k)) for k in rng.integers(1, 30, n)]


@pytest.fixture(scope="module")
def backend(small_model_dir):
    return TorchBackend(cfg(), small_model_dir, seed=0)


def test_logprobs_follow_the_generation_servers_convention(backend, small_model_dir):
    """log_softmax(logits / T)[next token], independently from the raw HF model, per token."""
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float64)
    ss = seqs()
    temperature = 0.7
    out = backend.forward_logprobs(pack(ss), temperature, with_entropy=True)
    k = 0
    for s in ss:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(s)[None]).logits[0]
        assert out.logp[k] == 0.0 and out.entropy[k] == 0.0     # nothing predicts a first token
        for i in range(1, len(s)):
            row = torch.log_softmax(logits[i - 1] / temperature, -1)
            assert float(out.logp[k + i]) == pytest.approx(float(row[s[i]]), abs=1e-5)
            ent = float(-(row.exp() * row).sum())
            assert float(out.entropy[k + i]) == pytest.approx(ent, abs=1e-5)
        k += len(s)


def test_packed_forward_equals_per_sequence_forward(small_model_dir):
    packed = TorchBackend(cfg(packed_forward=True), small_model_dir, 0)
    loop = TorchBackend(cfg(packed_forward=False), small_model_dir, 0)
    mb = pack(seqs(8, seed=3))
    a = packed.forward_logprobs(mb, 1.0, with_entropy=True)
    b = loop.forward_logprobs(mb, 1.0, with_entropy=True)
    assert torch.allclose(a.logp, b.logp, atol=1e-5)
    assert torch.allclose(a.entropy, b.entropy, atol=1e-5)


def _groups(traj, n_groups=4, size=2):
    return [Group(f"g{g}", 0, g, [traj(f"g{g}", k, group_size=size, reward=float((g + k) % 2),
                                       seed=10 * g + k, out_len=3 + (g * 5 + k) % 9, prompt_len=2 + g)
                                  for k in range(size)]) for g in range(n_groups)]


def _grads_after(backend, mbs, n_valid, settings):
    captured = {}

    def loss_fn(mb, out):
        f = mb.fields
        return ppo_token_loss(out.logp, f["behav_logp"], f.get("prox_logp"), f["advantages"], f["loss_mask"],
                              settings, n_valid)
    # Read the gradients where the optimizer would use them (after the all-reduce and clip),
    # and leave the parameters untouched so the next call starts from the same point.
    real_step = backend.optimizer.step
    backend.optimizer.step = lambda *a, **k: captured.update(
        {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None})
    try:
        backend.train_step(mbs, loss_fn, 1.0)
    finally:
        backend.optimizer.step = real_step
    return captured


def test_gradient_is_independent_of_the_micro_batch_split(small_model_dir, traj):
    """Gradient summing rule of backend.py: 1 micro-batch or many give the same gradient."""
    batch = StepBatch.from_groups(_groups(traj))
    settings = PPOSettings(0.2, False, None)
    be = TorchBackend(cfg(), small_model_dir, 0)
    one = plan_step(batch, 1, 10_000, 1, 0, True, True).minibatches[0]
    many = plan_step(batch, 1, 40, 1, 0, True, True).minibatches[0]
    assert len(one.micro_batches) == 1 and len(many.micro_batches) > 2
    g1 = _grads_after(be, one.micro_batches, one.n_valid, settings)
    g2 = _grads_after(be, many.micro_batches, many.n_valid, settings)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-7), n


def test_model_gradient_matches_a_float64_per_sequence_reference(small_model_dir, traj):
    """Backend packed path (float64) vs an independent loop: per sequence, per token, by hand."""
    batch = StepBatch.from_groups(_groups(traj, n_groups=2))
    settings = PPOSettings(0.2, False, None)
    be = TorchBackend(cfg(), small_model_dir, 0, dtype=torch.float64)
    plan = plan_step(batch, 1, 10_000, 1, 0, True, True).minibatches[0]
    got = _grads_after(be, plan.micro_batches, plan.n_valid, settings)

    ref = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float64)
    adv = plan_step(batch, 1, 10_000, 1, 0, True, True).advantages
    n_valid = sum(len(o) for o in batch.output_ids)
    total = 0
    for i in range(len(batch)):
        ids = torch.tensor(np.concatenate([batch.prompt_ids[i], batch.output_ids[i]]))
        logits = ref(input_ids=ids[None]).logits[0]
        p = len(batch.prompt_ids[i])
        for j, tok in enumerate(batch.output_ids[i]):
            lp = torch.log_softmax(logits[p + j - 1], -1)[int(tok)]
            r = torch.exp(lp - float(batch.behav_logp[i][j]))
            a = float(np.float32(adv[i]))   # the batch carries advantages as float32
            total = total - torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a) / n_valid
    total.backward()
    for n, p in ref.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-9, atol=1e-12), (n, (got[n] - p.grad).abs().max(), p.grad.abs().max())


def _one_minibatch(traj):
    """The groups of `traj` as one minibatch, and a clipped PPO loss over it."""
    mp = plan_step(StepBatch.from_groups(_groups(traj)), 1, 10_000, 1, 0, True, True).minibatches[0]

    def loss_fn(mb, out):
        f = mb.fields
        return ppo_token_loss(out.logp, f["behav_logp"], None, f["advantages"], f["loss_mask"],
                              PPOSettings(0.2, False, None), mp.n_valid)
    return mp, loss_fn


def test_train_step_changes_weights_and_state_dict_round_trips(small_model_dir, traj, tmp_path):
    be = build_backend(cfg(), small_model_dir, 0)
    mp, loss_fn = _one_minibatch(traj)
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    res = be.train_step(mp.micro_batches, loss_fn, 1.0)
    assert res.applied and res.grad_norm > 0 and res.stats["valid"] == mp.n_valid
    assert any(not torch.equal(before[n], p) for n, p in be.model.named_parameters())
    state = be.state_dict()
    other = TorchBackend(cfg(), small_model_dir, 0)
    other.load_state_dict(state)
    # one more identical step on both: identical parameters (optimizer moments restored)
    be.train_step(mp.micro_batches, loss_fn, 1.0)
    other.train_step(mp.micro_batches, loss_fn, 1.0)
    for (n, p), (_, q) in zip(be.model.named_parameters(), other.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    # exported HF directory loads with transformers and gives the same log-probs
    be.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "config.json").exists()
    loaded = TorchBackend(cfg(), tmp_path / "hf", 0)
    mb = pack(seqs())
    assert torch.equal(loaded.forward_logprobs(mb, 1.0).logp, be.forward_logprobs(mb, 1.0).logp)


def test_unknown_backend_is_a_clear_error(small_model_dir):
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        build_backend(cfg(backend="jax"), small_model_dir, 0)


def test_bf16_compute_multiplies_in_bf16_and_keeps_weights_gradients_and_adam_in_float32(small_model_dir, traj):
    """trainer.compute_dtype: bfloat16 (mixed precision): every matrix product of the forward and
    backward passes takes bf16 operands, while the parameters, their gradients and AdamW's moments
    stay float32; the log-probs are float32 and within bf16 rounding of the float32 backend's."""
    from op_count import OpCount

    class MatmulDtypes(OpCount):
        def __init__(self):
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "linear"):
                self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
            return super().__torch_dispatch__(func, types, args, kwargs)

    mp, loss_fn = _one_minibatch(traj)
    mixed = TorchBackend(cfg(compute_dtype="bfloat16"), small_model_dir, 0)
    exact = TorchBackend(cfg(), small_model_dir, 0)
    mb = pack(seqs())
    exact_lp, mixed_lp = exact.forward_logprobs(mb, 1.0).logp, mixed.forward_logprobs(mb, 1.0).logp   # same weights
    with MatmulDtypes() as seen:
        res = mixed.train_step(mp.micro_batches, loss_fn, 1.0)
    assert res.applied and seen.dtypes == {torch.bfloat16}, seen.dtypes
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert {v.dtype for st in mixed.optimizer.state.values() for k, v in st.items() if k != "step"} == {torch.float32}
    assert mixed_lp.dtype == torch.float32 and not torch.equal(exact_lp, mixed_lp)   # bf16 products
    assert float((exact_lp - mixed_lp).abs().mean()) < 0.05 * float(exact_lp.abs().mean())


def test_compute_dtype_is_checked_where_it_is_set():
    assert ("compute_dtype", "must be float32 or bfloat16, got 'fp16'") in cfg(compute_dtype="fp16").problems()
    assert any(k == "compute_dtype" and "trainer.megatron.params_dtype" in m
               for k, m in cfg(backend="megatron", compute_dtype="bfloat16").problems())


def test_recompute_keeps_layer_inputs_only_and_changes_no_gradient(small_model_dir):
    """trainer.recompute: each decoder layer runs again in the backward pass (more matrix
    products), the forward keeps less alive at once (LiveBytesPeak: the CPU stand-in for a GPU's
    peak memory, tests/support/logprob_head_case.py), and the step's gradients and updated weights
    are the same numbers; forwards without gradients (the proximal pass) run each layer once."""
    from logprob_head_case import LiveBytesPeak
    from op_count import OpCount

    mb = pack(seqs(12, seed=5))

    def loss_fn(_, out):
        loss = -out.logp.sum() / mb.n_tokens
        return loss, {"loss": float(loss.detach())}

    runs = {}
    for on in (False, True):
        be = TorchBackend(cfg(recompute=on, logprob_chunk=0), small_model_dir, 0)
        with OpCount() as count, LiveBytesPeak() as live:
            res = be.train_step([mb], loss_fn, 1.0)
        with OpCount() as no_grad:
            be.forward_logprobs(mb, 1.0)
        runs[on] = (count.ops.get("mm", 0) + count.ops.get("addmm", 0), live.peak, res.grad_norm,
                    {n: p.detach().clone() for n, p in be.model.named_parameters()},
                    no_grad.ops.get("mm", 0) + no_grad.ops.get("addmm", 0))
    (mm_off, peak_off, gn_off, w_off, fwd_off), (mm_on, peak_on, gn_on, w_on, fwd_on) = runs[False], runs[True]
    assert mm_on > mm_off and peak_on < peak_off and fwd_on == fwd_off, (mm_off, mm_on, peak_off, peak_on)
    assert gn_on == gn_off
    for n, w in w_off.items():
        assert torch.equal(w, w_on[n]), n


def test_recompute_is_the_torch_backends_option():
    assert any(k == "recompute" and "trainer.megatron.recompute" in m
               for k, m in cfg(backend="megatron", recompute=True).problems())
