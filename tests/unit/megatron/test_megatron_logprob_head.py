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
