"""The Megatron backend's log-probs from hidden states (trainer/megatron/logprob_head.py), TP=1,
in this process: the same log-probs, entropies and parameter gradients as the rows path it
replaced (gathered logits, then token_logprobs), tied and untied embeddings, chunked and whole;
and no operation of the chunked step, forward or backward, makes a tensor of the vocabulary's
width with more than a chunk of rows (the rows path makes [tokens, vocab]: the check sees it).

TP=2 (vocabulary-parallel): tests/integration/megatron/test_megatron_logprob_head_tp2.py.
"""
from __future__ import annotations

import logprob_head_case as lc
import megatron_case as mc
import pytest
import torch

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def compared(request, tmp_path_factory) -> dict:
    d = mc.make_model_dir(tmp_path_factory.mktemp("qwen2"), tied=request.param)
    backend = mc.in_process_backend(d)
    be = next(backend)
    try:
        assert be.shape.tie_word_embeddings is request.param
        return lc.compare(be)
    finally:
        next(backend, None)   # closes it (Megatron's process groups are per process)


@pytest.mark.parametrize("chunk", [8, 0])
def test_hidden_state_logprobs_equal_the_rows_path(compared, chunk):
    assert compared["padded_vocab"] > mc.VOCAB   # the padding rows exist and are left out
    case = compared[chunk]
    lc.assert_paths_equal(case)
    # the output weight's gradient reaches the padded rows as zeros (they are in no softmax)
    name = next(n for n in case["new"]["grads"] if n.endswith(("output_layer.weight", "word_embeddings.weight")))
    assert case["new"]["grads"][name][mc.VOCAB:].eq(0).all()


def test_no_operation_makes_a_tensor_of_tokens_by_vocabulary(compared):
    n = compared["n_tokens"]
    rows, shape = compared[8]["widest_new"]
    assert rows <= 8, shape
    # the same check sees the rows path's [tokens, vocab] logits (the check is not blind)
    rows_old, shape_old = compared[8]["widest_rows"]
    assert rows_old >= n, shape_old
    # chunk 0: one piece, the whole micro-batch at once (trainer.logprob_chunk: 0)
    assert compared[0]["widest_new"][0] >= n


def test_the_hidden_states_are_the_output_layer_s_input(compared):
    """gpu.forward_thd_hidden: GPTModel's output (post_process cleared for the call) is the final
    norm's output, the output weight times it is the model's logits, and the flag is restored."""
    assert compared["logits_from_hidden_err"] < 1e-5
    assert compared["post_process_after"] is True


def test_through_megatron_ddp_the_gradients_land_in_main_grad(tmp_path):
    """The GPU path's wrapping: Megatron's real DistributedDataParallel (it runs on CPU) around a
    float32 GPTModel with the backend's weights (tied embeddings). forward_thd_hidden reaches the
    GPTModel through the wrapper, and DDP's gradient hooks move the chunked output layer's
    gradient (a plain product with the weight, not ColumnParallelLinear's) into `main_grad`: every
    parameter's `main_grad` is the rows path's gradient."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron_gpu_on_cpu import cuda_on_cpu

    from tandem.trainer.megatron import cpu_compat, gpu
    from tandem.trainer.megatron.config import MegatronConfig
    from tandem.trainer.megatron.logprob_head import hidden_logprobs
    from tandem.trainer.megatron.model import build_gpt_model, layer_spec

    backend = mc.in_process_backend(mc.make_model_dir(tmp_path, tied=True))
    be = next(backend)
    try:
        be.cfg.logprob_chunk = 8
        mb = lc.batch()
        ref = lc.run_path(be, mb, rows_path=True)
        with cpu_compat.model_construction():
            model = build_gpt_model(be.shape, be.config, layer_spec(False, be.shape.qk_norm), be.padded_vocab)
        be.load_model_state(be._module().state_dict(), model)
        with cuda_on_cpu():
            ddp = DistributedDataParallel(config=be.config, module=model,
                                          ddp_config=gpu.ddp_config(MegatronConfig(use_distributed_optimizer=False)))
        ddp.zero_grad_buffer()
        hidden = gpu.forward_thd_hidden(ddp, mb.input_ids[None], mb.position_ids[None], mb.cu_seqlens, be.device)
        out = hidden_logprobs(model, hidden, mb.input_ids, mb.cu_seqlens, lc.TEMPERATURE, True, True, 8, mc.VOCAB)
        ((mb.fields["adv"] * out.logp).sum() + lc.ENTROPY_COEF * out.entropy.sum()).backward()
        assert model.post_process
        for name, p in model.named_parameters():
            assert p.grad is None, name   # moved into main_grad by DDP's hook
            g = ref["grads"][name]
            torch.testing.assert_close(p.main_grad, g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)
    finally:
        next(backend, None)


def test_live_bytes_peak_at_qwen2_5_s_vocabulary_is_under_a_quarter_of_the_whole_pass(tmp_path):
    """Issue 37's done-when, emulated on the CPU: the peak of live tensor bytes of the log-prob
    step (from the final hidden states, forward and backward, every tensor an operation makes:
    lc.LiveBytesPeak) at Qwen2.5's 151,936-entry vocabulary, against the whole pass (logits
    whole, log-softmax whole) and the rows path the backend used before (logits whole,
    log-softmax chunked). 128 tokens in chunks of 4: tokens / chunk is 32, as for a 32K-token
    pack at the default chunk of 1,024; hidden / tokens is 1/8 (16 / 128), so the output layer's [vocab x
    hidden] gradients stay small beside a [tokens x vocab] tensor, as they are at that pack's
    size (hidden 1,536 / 32K tokens is smaller still). Float32 here (the CPU path), so the rows path keeps more
    of the whole than on a GPU, where its logits are bf16 (benchmarks/results/logprob_memory.json);
    the GPU's own figure is tests/gpu/test_gpu_megatron_logprob_memory.py's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151_936, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    backend = mc.in_process_backend(mc.save_random(Qwen2ForCausalLM(cfg), tmp_path / "qwen2-152k"))
    be = next(backend)
    try:
        gen = torch.Generator().manual_seed(0)
        mb = mc.packed([torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (32, 32, 32, 32)], 0)
        with torch.no_grad():
            hidden = be._stage_forward(mb)
        peaks = {}
        for mode, chunk in (("whole", 0), ("rows", 4), ("head", 4)):
            be.cfg.logprob_chunk = chunk
            meter = lc.LiveBytesPeak()
            with meter:
                lc.run_path(be, mb, mode != "head", hidden=hidden.detach().requires_grad_(True), entropy_grad=False)
            peaks[mode] = meter.peak
    finally:
        next(backend, None)
    n_by_vocab = 128 * cfg.vocab_size * 4
    assert peaks["whole"] >= 2 * n_by_vocab, peaks      # the meter sees the whole pass's tensors
    assert peaks["head"] <= peaks["whole"] / 4, peaks
    assert peaks["head"] <= peaks["rows"] / 4, peaks
