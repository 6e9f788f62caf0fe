"""Seeded sampling is reproducible, and the reported log-probs are log_softmax(logits / T) of a
plain transformers forward pass over the same tokens (the convention the trainer reproduces)."""
from __future__ import annotations

import pytest
import torch
from gen_support import reference_logprobs

PROMPT = [1, 6, 57, 50, 58]


def test_seeded_sampling_is_reproducible(shared_server):
    params = dict(max_new_tokens=40, temperature=1.0, ignore_eos=True, sampling_seed=1234)
    a = shared_server.generate(PROMPT, **params)
    b = shared_server.generate(PROMPT, **params)
    c = shared_server.generate(PROMPT, **{**params, "sampling_seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_logprobs_match_transformers_forward(shared_server, tiny_model_dir, embedded_only, temperature):
    out = shared_server.generate(PROMPT, max_new_tokens=30, temperature=temperature, ignore_eos=True,
                                 sampling_seed=7)
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = reference_logprobs(tiny_model_dir, PROMPT, out["output_ids"], temperature or 1.0)
    assert got == pytest.approx(want, abs=1e-4)


def test_greedy_is_argmax_and_top_k_one_is_greedy(shared_server, tiny_model_dir, embedded_only):
    greedy = shared_server.generate(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True)["output_ids"]
    top1 = shared_server.generate(PROMPT, max_new_tokens=10, temperature=1.3, top_k=1, ignore_eos=True)
    assert top1["output_ids"] == greedy
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + greedy])).logits[0]
    assert logits[len(PROMPT) - 1: -1].argmax(-1).tolist() == greedy
