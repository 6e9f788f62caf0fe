"""The vocabulary-parallel log-probs of trainer/megatron/logprob_head.py at TP=2, in a real
2-process job (gloo, CPU): each rank makes the logits of its vocabulary shard a chunk of tokens
at a time, and the log-softmax, target logit and entropy are all-reduced over the TP group.

Against the rows path it replaced (logits gathered over TP, then token_logprobs), on each rank:
the same log-probs and entropies to float32 rounding, the same gradient of every parameter
shard (a loss of log-probs and entropies: the all-reduces' backward is right), tied and untied
embeddings, and the vocabulary padding left out where Megatron pads (61 tokens padded to 256
with the default multiple: rank 1's shard is all padding; to 80 with a multiple of 10: the true
vocabulary ends inside rank 1's shard). No operation of the chunked step, forward or backward,
makes a tensor of a vocabulary width with more than a chunk of rows; the rows path does.
"""
from __future__ import annotations

from pathlib import Path

import logprob_head_case as lc
import megatron_case as mc
import pytest
import torch
from rank_processes import rank_errors, reap, start_ranks

pytestmark = pytest.mark.timeout(300)
WORKER = Path(__file__).resolve().parent / "logprob_head_tp2_worker.py"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("logprob-head")
    tied = mc.make_model_dir(root / "tied", tied=True)
    untied = mc.make_model_dir(root / "untied", tied=False)
    cases = {"tied-128": f"{tied}:128", "untied-128": f"{untied}:128", "tied-10": f"{tied}:10",
             "untied-10": f"{untied}:10"}
    procs, logs = start_ranks(["-m", "logprob_head_tp2_worker", str(root), *cases.values()], root, "head")
    try:
        errors = rank_errors(procs, logs, timeout_s=240)
    finally:
        reap(procs)
    assert not errors, "\n----\n".join(errors)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {name: [ranks[r][spec] for r in (0, 1)] for name, spec in cases.items()}


CASES = ["tied-128", "untied-128", "tied-10", "untied-10"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chunk", [8, 0])
def test_vocab_parallel_logprobs_and_gradients_equal_the_rows_path(tp2, name, chunk):
    for rank, res in enumerate(tp2[name]):
        assert (res["tp_rank"], res["tp_size"]) == (rank, 2)
        lc.assert_paths_equal(res[chunk])
    # every rank computed the same log-probs and entropies (the loss is the same on each)
    r0, r1 = (res[chunk]["new"] for res in tp2[name])
    assert torch.equal(r0["logp"], r1["logp"]) and torch.equal(r0["entropy"], r1["entropy"])


def test_the_padding_splits_the_vocabulary_as_described(tp2):
    assert tp2["tied-128"][0]["padded_vocab"] == 256 and tp2["tied-128"][1]["widths"] == [61, 128, 256]
    assert tp2["tied-10"][0]["padded_vocab"] == 80
    assert tp2["tied-10"][0]["widths"] == [40, 61, 80] and tp2["tied-10"][1]["widths"] == [21, 40, 61, 80]


@pytest.mark.parametrize("name", CASES)
def test_no_operation_makes_a_tensor_of_tokens_by_vocabulary(tp2, name):
    for res in tp2[name]:
        rows, shape = res[8]["widest_new"]
        assert rows <= 8, shape
        assert res[8]["widest_rows"][0] >= res["n_tokens"], res[8]["widest_rows"]


def test_tp2_logprobs_equal_tp1(tp2, tmp_path):
    """The vocabulary-parallel values are the single rank's (TP=1, this process)."""
    backend = mc.in_process_backend(mc.make_model_dir(tmp_path, tied=True))
    be = next(backend)
    try:
        be.cfg.logprob_chunk = 8
        one = lc.run_path(be, lc.batch(), rows_path=False)
    finally:
        next(backend, None)
    got = tp2["tied-128"][0][8]["new"]
    torch.testing.assert_close(got["logp"], one["logp"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["entropy"], one["entropy"], rtol=1e-5, atol=1e-5)
