"""Both backends' forward and train step on CUDA in bf16 against an fp32 reference on the same GPU
(TF32 off), with the tolerances derived in tolerances.py; packed against per-sequence forward.

A first GPU run saw the packed and per-sequence forwards of the Megatron backend differ by 0.044
in bf16 and could not tell bf16 noise from a packing error: here both are held to the bound
derived for bf16, and both to the fp32 reference.
"""
from __future__ import annotations

import megatron_case as mc
import pytest
import tolerances as tol
from workers import run_worker

pytestmark = pytest.mark.timeout(600)
LAYERS = 2   # megatron_case's model


@pytest.fixture(scope="module", params=["torch", "megatron"])
def runs(request, case_model, bf16_run, tmp_path_factory):
    """(backend, bf16 result, fp32 result, logits rms): the same first step from the same weights."""
    d = tmp_path_factory.mktemp(f"fp32-{request.param}")
    ref = run_worker(d / "fp32.pt", "--backend", request.param, "--dtype", "float32", "--model", case_model,
                     "--steps", "1")
    return request.param, bf16_run(request.param), ref, tol.logits_rms(case_model, mc.micro_batches(seed=0))


def assert_within_bf16_bounds(what: str, bf: dict, ref: dict, rms: float) -> None:
    """A bf16 run's log-probs before its step, its gradient norm, and its step's effect on the
    policy, against the fp32 reference's, within tolerances.py's bounds for bf16."""
    mean_tol, max_tol = tol.logp_bounds(LAYERS, rms)
    err = (bf["logp"][0] - ref["logp"][0]).abs()
    assert err.mean() <= mean_tol and err.max() <= max_tol, (what, float(err.mean()), float(err.max()),
                                                              mean_tol, max_tol)
    g, g_ref = bf["grad_norms"][0], ref["grad_norms"][0]
    assert bf["applied"][0] and abs(g - g_ref) <= tol.grad_norm_rtol(LAYERS) * g_ref, (what, g, g_ref)
    effect, effect_ref = bf["logp"][1] - bf["logp"][0], ref["logp"][1] - ref["logp"][0]
    assert effect_ref.pow(2).mean().sqrt() >= tol.MIN_EFFECT_OVER_NOISE * mean_tol, "the step moves too little"
    assert tol.cosine(effect, effect_ref) >= tol.MIN_COSINE, (what, tol.cosine(effect, effect_ref))


def test_bf16_forward_and_train_step_match_the_fp32_reference(runs, on_gpu):
    backend, bf, ref, rms = runs
    if tol.bf16_parameters_expected(backend, on_gpu):   # (the first H200 run failed here on a typo)
        assert "torch.bfloat16" in bf["param_dtypes"] and ref["param_dtypes"] == ["torch.float32"], (bf, ref)
    assert_within_bf16_bounds(backend, bf, ref, rms)


def test_packed_and_per_sequence_forward_agree_in_bf16(runs):
    backend, bf, ref, rms = runs
    mean_tol, max_tol = tol.logp_bounds(LAYERS, rms)
    for k in (0, 1):   # before and after the step
        packed, single = bf["logp"][k], bf["per_seq"][k]
        diff = (packed - single).abs()
        assert diff.mean() <= 2 * mean_tol and diff.max() <= max_tol, (backend, k, float(diff.mean()),
                                                                       float(diff.max()), mean_tol, max_tol)
    for name, got in (("packed", bf["logp"][0]), ("per-sequence", bf["per_seq"][0])):
        err = (got - ref["per_seq"][0]).abs()     # either is the fp32 function, to bf16 noise
        assert err.max() <= max_tol, (backend, name, float(err.max()))
    # fp32: the two forwards are the same function to fp32 rounding.
    assert (ref["logp"][0] - ref["per_seq"][0]).abs().max() <= 1e-4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_torch_backend_as_runs_train_it_matches_the_fp32_reference(case_model, tmp_path, compiled):
    """`trainer.compute_dtype: bfloat16` with `trainer.recompute: true`, the torch backend's GPU
    setting for runs (docs/trainer.md, "Precision"): float32 weights, gradients and AdamW, bf16
    products under autocast, every decoder layer recomputed in the backward pass; and the same
    with `trainer.compile: true` (Inductor's Triton kernels). Held to the bounds of a bf16 forward
    against the fp32 reference on the same device."""
    common = ("--backend", "torch", "--dtype", "float32", "--model", case_model, "--steps", "1")
    mixed = run_worker(tmp_path / "mixed.pt", *common, "--compute-dtype", "bfloat16", "--recompute", "1",
                       "--compile", str(int(compiled)))
    ref = run_worker(tmp_path / "fp32.pt", *common)
    assert mixed["param_dtypes"] == ["torch.float32"], mixed["param_dtypes"]
    assert (mixed["logp"][0] - ref["logp"][0]).abs().mean() > 0    # the products really are bf16
    assert_within_bf16_bounds(f"torch, compute_dtype bfloat16, compile {compiled}", mixed, ref,
                              tol.logits_rms(case_model, mc.micro_batches(seed=0)))


def test_megatron_with_compile_matches_the_fp32_reference(case_model, tmp_path):
    """`trainer.compile: true` on the Megatron backend (megatron-core's fused SwiGLU under
    torch.compile, the compiled log-prob chunks: Triton kernels here), bf16 parameters, held to
    the bounds of a bf16 forward against the fp32 reference on the same device."""
    common = ("--backend", "megatron", "--model", case_model, "--steps", "1")
    fused = run_worker(tmp_path / "compiled.pt", *common, "--dtype", "bfloat16", "--compile", "1")
    ref = run_worker(tmp_path / "fp32.pt", *common, "--dtype", "float32")
    assert_within_bf16_bounds("megatron, compile", fused, ref, tol.logits_rms(case_model, mc.micro_batches(seed=0)))
