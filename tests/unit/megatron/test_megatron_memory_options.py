"""The Megatron backend's memory options change memory, not numbers: activation recompute
(`trainer.megatron.recompute`) and the chunked float32 log-softmax (`trainer.megatron.logprob_chunk`)
give the log-probs, entropies and update of the plain path (real megatron-core 0.16.1 on CPU,
float32, one rank). `tandem plan`'s memory estimate counts on both (docs/plan.md)."""
from __future__ import annotations

import dataclasses

import megatron_case as mc
import pytest
import torch

from trainer.megatron.logprobs import chunked_token_logprobs
from trainer.torch_backend import token_logprobs

pytestmark = pytest.mark.timeout(240)


def _case(n: int = 23, vocab: int = 37, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(n, vocab, generator=gen)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    cu = torch.tensor([0, 5, 6, 15, n], dtype=torch.int32)
    return logits, ids, cu


@pytest.mark.parametrize("chunk", [1, 4, 7, 23, 100])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_equal_the_whole_pass_with_gradients(chunk, entropy_grad):
    logits, ids, cu = _case()
    ref = token_logprobs(logits, ids, cu, 0.7, True, entropy_grad)
    got = chunked_token_logprobs(logits, ids, cu, 0.7, True, entropy_grad, chunk)
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=0, atol=0)
    assert got.logp[cu[:-1].long()].eq(0).all()   # sequence starts are nothing's prediction
    assert got.entropy.requires_grad is entropy_grad
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(5))

    def grad(out):
        loss = (weights * out.logp).sum() + (out.entropy.sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, logits)[0]
    torch.testing.assert_close(grad(got), grad(ref), rtol=1e-6, atol=1e-7)


def test_chunked_logprobs_of_bf16_logits_are_the_float32_pass_of_the_same_values():
    """GPU logits are bf16: a chunk is cast to float32 inside, as the whole pass casts first."""
    logits, ids, cu = _case(dtype=torch.bfloat16)
    ref = token_logprobs(logits.float(), ids, cu, 1.0, False)
    got = chunked_token_logprobs(logits, ids, cu, 1.0, False, False, 6)
    assert got.logp.dtype == torch.float32 and got.entropy is None
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=0)
    g = torch.autograd.grad(got.logp.sum(), logits)[0]
    assert g.dtype == torch.bfloat16 and g.abs().sum() > 0


def _after_one_update(model_dir, monkeypatch, **megatron):
    """(log-probs before, entropies, parameters after one update, layers run under Megatron's
    recompute) of a fresh in-process backend."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from trainer.megatron.backend import MegatronBackend

    recomputed = []
    real = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint",
                        lambda fn, *a, **k: recomputed.append(1) or real(fn, *a, **k))
    cfg = mc.trainer_cfg(tp=1, params_dtype="float32")
    cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, **megatron))
    created = not dist.is_initialized()
    be = MegatronBackend(cfg, model_dir, seed=0)
    try:
        mbs = mc.micro_batches(seed=1)
        outs = [be.forward_logprobs(mb, 0.8, with_entropy=True) for mb in mbs]
        be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 0.8)
        params = {k: v.detach().clone() for k, v in be._module().state_dict().items()
                  if isinstance(v, torch.Tensor)}
        return torch.cat([o.logp for o in outs]), torch.cat([o.entropy for o in outs]), params, len(recomputed)
    finally:
        be.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_recompute_and_chunking_leave_log_probs_and_the_update_unchanged(tmp_path, monkeypatch):
    from trainer.megatron.backend import read_hf_tensors

    model_dir = mc.make_model_dir(tmp_path / "m", tied=False)
    plain = _after_one_update(model_dir, monkeypatch)
    lean = _after_one_update(model_dir, monkeypatch, recompute=True, logprob_chunk=5)
    # Megatron's recompute ran (one unit per layer, in the training forward only) and did not otherwise
    assert plain[3] == 0 and lean[3] == 2 * 2
    torch.testing.assert_close(lean[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(lean[1], plain[1], rtol=0, atol=0)
    assert plain[2].keys() == lean[2].keys()
    for k, v in plain[2].items():
        torch.testing.assert_close(lean[2][k], v, rtol=1e-6, atol=1e-7, msg=k)
    # the update moved the model: both runs agree on a trained model, not on an untouched one
    before = read_hf_tensors(model_dir)["model.embed_tokens.weight"]
    assert not torch.equal(plain[2]["embedding.word_embeddings.weight"][: before.shape[0]], before)


def test_recompute_is_megatrons_full_layer_recompute():
    from trainer.megatron.model import transformer_config
    from trainer.megatron.shape import DecoderShape

    shape = DecoderShape(vocab_size=61, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainer.megatron.model import init_parallel
    created = not dist.is_initialized()
    init_parallel(1, 1)
    try:
        on = transformer_config(shape, torch.float32, False, recompute=True)
        off = transformer_config(shape, torch.float32, False)
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    assert (on.recompute_granularity, on.recompute_method, on.recompute_num_layers) == ("full", "uniform", 1)
    assert off.recompute_granularity is None
