"""Checkpoints on the GPU: Megatron's dist checkpoint (both optimizers) resumes to the same next
step; a GPU checkpoint loads on the CPU path (one format on both devices); the Hugging Face
export of a bf16 run loads in transformers and generates.

A first GPU run found the Megatron dist checkpoint failing with either optimizer (optimizer vs
model shard shapes 128 vs 256): on GPUs there was no checkpoint and no resume.
"""
from __future__ import annotations

import megatron_case as mc
import pytest
import tolerances as tol
import torch
from workers import run_worker

pytestmark = pytest.mark.timeout(600)
LAYERS = 2


@pytest.mark.parametrize("dist_opt", [1, 0], ids=["distributed-optimizer", "plain-optimizer"])
def test_megatron_dist_checkpoint_save_load_gives_the_same_next_step(tmp_path, case_model, bf16_run, dist_opt):
    """Train 2 steps saving after 1; a fresh process loads that checkpoint and trains step 2: the
    same gradient norm and the same weights after it, which needs the optimizer state."""
    args = ("--backend", "megatron", "--dtype", "bfloat16", "--dist-opt", dist_opt, "--model", case_model)
    if dist_opt:
        whole = bf16_run("megatron")
        ck = whole["ckpt"]
    else:
        ck = tmp_path / "ckpt"
        whole = run_worker(tmp_path / "whole.pt", *args, "--steps", 2, "--save-after", 1, ck)
    resumed = run_worker(tmp_path / "resumed.pt", *args, "--steps", 1, "--load", ck, "--start-step", 1)
    assert (ck / "metadata.json").exists() or any(ck.iterdir()), "no dist checkpoint written"
    assert torch.equal(resumed["logp"][0], whole["logp"][1]), "the loaded weights are not the saved ones"
    g, g_ref = resumed["grad_norms"][0], whole["grad_norms"][1]
    assert abs(g - g_ref) <= 1e-4 * g_ref, (g, g_ref)
    step2 = whole["logp"][2] - whole["logp"][1]
    diff = (resumed["logp"][1] - whole["logp"][2]).abs().max()
    # The same kernels on the same data: equal up to reduction order. Fresh Adam moments would
    # move the weights by lr * sign(g) instead: a large part of the step.
    assert diff <= max(1e-5, 0.02 * float(step2.abs().max())), (float(diff), float(step2.abs().max()))


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_gpu_checkpoint_loads_and_trains_on_the_cpu(tmp_path, case_model, bf16_run, backend, on_gpu):
    """Saved by a bf16 GPU run after step 1; loaded by the CPU path (fp32) in a process that sees
    no GPU: the same policy (to bf16 forward noise) and a step 2 that continues it with the
    saved optimizer state — closer to the GPU's step 2 than a step from fresh moments (the
    run's own export after step 1, loaded as a new model) is."""
    args = ("--backend", backend, "--model", case_model)
    gpu = bf16_run(backend)
    ck, hf = gpu["ckpt"], gpu["hf"]
    cpu = run_worker(tmp_path / "cpu.pt", *args, "--dtype", "float32", "--steps", 1, "--load", ck, "--start-step", 1,
                     cpu=True)
    fresh = run_worker(tmp_path / "fresh.pt", "--backend", backend, "--model", hf, "--dtype", "float32",
                       "--steps", 1, "--start-step", 1, cpu=True)
    assert cpu["device"] == "cpu" and (gpu["device"] != "cpu") == on_gpu
    mean_tol, max_tol = tol.logp_bounds(LAYERS, tol.logits_rms(case_model, mc.micro_batches(seed=0)))
    err = (cpu["logp"][0] - gpu["logp"][1]).abs()
    assert err.mean() <= mean_tol and err.max() <= max_tol, (float(err.mean()), float(err.max()))
    gpu_step2 = gpu["logp"][2] - gpu["logp"][1]
    cos_resumed = tol.cosine(cpu["logp"][1] - cpu["logp"][0], gpu_step2)
    cos_fresh = tol.cosine(fresh["logp"][1] - fresh["logp"][0], gpu_step2)
    assert cos_resumed >= tol.MIN_COSINE and cos_resumed > cos_fresh, (cos_resumed, cos_fresh)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_hf_export_of_a_bf16_run_loads_in_transformers_and_generates(case_model, bf16_run, backend):
    from transformers import AutoModelForCausalLM

    run = bf16_run(backend)
    hf = run["hf"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    mb = mc.micro_batches(seed=0)[0]
    prompt = mb.input_ids[None, : int(mb.cu_seqlens[1])]
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + 6 and bool((out[0, -6:] < mc.VOCAB).all())
    # The exported weights are the trained ones: transformers' fp32 log-probs of the first
    # sequence equal the run's own (bf16) after the step, to the bf16 forward bound.
    with torch.no_grad():
        logp = torch.log_softmax(model(prompt).logits[0, :-1].float(), -1).gather(-1, prompt[0, 1:, None])[:, 0]
    _, max_tol = tol.logp_bounds(LAYERS, tol.logits_rms(case_model, mc.micro_batches(seed=0)))
    got = run["logp"][1][1: prompt.shape[1]]
    assert (logp - got).abs().max() <= max_tol, float((logp - got).abs().max())
