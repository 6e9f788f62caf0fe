"""The Megatron backend's memory options change memory, not numbers: activation recompute
(`trainer.megatron.recompute`) and the chunked output layer and log-softmax
(`trainer.logprob_chunk`, tests/unit/trainer/test_logprobs.py for the function itself,
tests/unit/megatron/test_megatron_logprob_head.py for the backend's) give the log-probs,
entropies and gradients of the plain path (real megatron-core 0.16.1 on CPU, float32, one rank).
`tandem plan`'s memory estimate counts on both (docs/plan.md).

Gradients, not the updated weights: with the output layer applied a chunk at a time, its
weight's gradient is a sum of per-chunk products (another summation order than one matrix
product), equal to float32 rounding; Adam's first step divides each gradient by its own
magnitude, so a weight whose gradient is rounding-level moves by about +-lr either way."""
from __future__ import annotations

import dataclasses

import megatron_case as mc
import pytest
import torch

pytestmark = pytest.mark.timeout(240)


def _after_one_update(model_dir, monkeypatch, logprob_chunk=0, **megatron):
    """(log-probs before, entropies, gradients of one update, layers run under Megatron's
    recompute, parameters after the update) of a fresh in-process backend."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from tandem.trainer.megatron.backend import MegatronBackend

    recomputed = []
    real = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint",
                        lambda fn, *a, **k: recomputed.append(1) or real(fn, *a, **k))
    cfg = mc.trainer_cfg(tp=1, params_dtype="float32")
    cfg = dataclasses.replace(cfg, logprob_chunk=logprob_chunk,
                              megatron=dataclasses.replace(cfg.megatron, **megatron))
    created = not dist.is_initialized()
    be = MegatronBackend(cfg, model_dir, seed=0)
    try:
        mbs = mc.micro_batches(seed=1)
        outs = [be.forward_logprobs(mb, 0.8, with_entropy=True) for mb in mbs]
        grads = {}
        step = be.optimizer.step

        def record_then_step(*a, **k):
            grads.update({n: p.grad.clone() for n, p in be._module().named_parameters() if p.grad is not None})
            return step(*a, **k)
        be.optimizer.step = record_then_step
        be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 0.8)
        params = {k: v.detach().clone() for k, v in be._module().state_dict().items()
                  if isinstance(v, torch.Tensor)}
        return (torch.cat([o.logp for o in outs]), torch.cat([o.entropy for o in outs]), grads, len(recomputed),
                params)
    finally:
        be.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_recompute_and_chunking_leave_log_probs_and_the_update_unchanged(tmp_path, monkeypatch):
    from tandem.trainer.megatron.backend import read_hf_tensors

    model_dir = mc.make_model_dir(tmp_path / "m", tied=False)
    plain = _after_one_update(model_dir, monkeypatch)
    lean = _after_one_update(model_dir, monkeypatch, recompute=True, logprob_chunk=5)
    # Megatron's recompute ran (one unit per layer, in the training forward only) and did not otherwise
    assert plain[3] == 0 and lean[3] == 2 * 2
    # float32 rounding, not bit for bit: the chunks' output-layer products are matrix products of
    # other shapes, and a CPU's BLAS may sum a row's product in another order for another shape
    # (AVX-512 kernels did: one log-prob of 41 one ulp apart)
    torch.testing.assert_close(lean[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lean[1], plain[1], rtol=1e-6, atol=1e-6)
    assert plain[2].keys() == lean[2].keys()
    for k, v in plain[2].items():
        torch.testing.assert_close(lean[2][k], v, rtol=1e-5, atol=1e-6 * float(v.abs().max()), msg=k)
    # the update moved the model
    before = read_hf_tensors(model_dir)["model.embed_tokens.weight"]
    assert not torch.equal(plain[4]["embedding.word_embeddings.weight"][: before.shape[0]], before)


def test_recompute_is_megatrons_full_layer_recompute_and_compile_its_fused_swiglu():
    from tandem.trainer.megatron.model import transformer_config
    from tandem.trainer.megatron.shape import DecoderShape

    shape = DecoderShape(vocab_size=61, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tandem.trainer.megatron.model import init_parallel
    created = not dist.is_initialized()
    init_parallel(1, 1)
    try:
        on = transformer_config(shape, torch.float32, False, recompute=True)
        off = transformer_config(shape, torch.float32, False)
        fused = transformer_config(shape, torch.float32, False, fused_activation=True)   # trainer.compile
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    assert (on.recompute_granularity, on.recompute_method, on.recompute_num_layers) == ("full", "uniform", 1)
    assert off.recompute_granularity is None
    assert fused.bias_activation_fusion and not on.bias_activation_fusion and not off.bias_activation_fusion


def test_auto_recompute_follows_the_devices_memory(tmp_path, monkeypatch):
    """trainer.megatron.recompute: auto (trainer/recompute.py): a device too small for the pack
    (the stand-in TANDEM_DEVICE_MEMORY_BYTES) turns on the full layer recompute above; the CPU,
    whose memory is not finite, leaves it off. The choice is the backend's record of it."""
    import torch.distributed as dist

    from tandem.trainer import recompute
    from tandem.trainer.megatron.backend import MegatronBackend

    model_dir = mc.make_model_dir(tmp_path / "m", tied=False)
    cfg = mc.trainer_cfg(tp=1, params_dtype="float32")
    cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, recompute="auto"))
    seen = {}
    for cap in ("1e6", None):
        if cap:
            monkeypatch.setenv(recompute.ENV, cap)
        else:
            monkeypatch.delenv(recompute.ENV, raising=False)
        created = not dist.is_initialized()
        be = MegatronBackend(cfg, model_dir, seed=0)
        try:
            seen[cap] = (be.recompute_choice, be.mcfg.recompute, be.config.recompute_granularity,
                         be.config.recompute_method, be.config.recompute_num_layers)
        finally:
            be.close()
            if created and dist.is_initialized():
                dist.destroy_process_group()
    small, cpu = seen["1e6"], seen[None]
    assert small[0].on and small[0].key == "trainer.megatron.recompute" and small[1:] == (True, "full", "uniform", 1)
    assert not cpu[0].on and cpu[0].capacity is None and cpu[1:] == (False, None, None, None)
