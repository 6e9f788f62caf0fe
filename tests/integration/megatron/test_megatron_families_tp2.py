"""Qwen3 at TP=2 in a real 2-process job (gloo, CPU) takes the step the single rank takes.

What TP changes for Qwen3: its q/k norms are one [head_dim] weight each, replicated, but each TP
rank normalises only its own heads with it, so each rank's gradient is a part; the backend sums
the parts over the TP group (the GPU path: `finalize_model_grads` with `qk_layernorm`). Without
that sum the q/k norm gradients, and with them the gradient norm, differ from the TP=1 step.
The job's dist checkpoint is exported to HF tensors here, as `tandem export` does.
"""
from __future__ import annotations

from pathlib import Path

import megatron_case as mc
import megatron_families as mf
import pytest
import torch
from rank_processes import rank_errors, reap, start_ranks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return mf.make_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def tp2(qwen3_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp2")
    procs, logs = start_ranks(["-m", "families_tp2_worker", str(qwen3_dir), str(out)], out, "tp2")
    try:
        errors = rank_errors(procs, logs, timeout_s=180)
    finally:
        reap(procs)   # dist_checkpointing's writer processes, if any outlived their rank
    assert not errors, "\n----\n".join(errors)
    return torch.load(out / "tp2.pt", weights_only=False) | {"dir": out}


def test_qwen3_tp2_dist_checkpoint_exports_the_trained_weights(qwen3_dir, tp2):
    """`tandem export`'s path (trainer/megatron/export.py): the TP=2 checkpoint, resharded into
    one CPU process, names q/k norms as transformers does and holds the step-1 weights exactly."""
    from tandem.trainer.megatron.export import hf_state_from_dist

    state = hf_state_from_dist(tp2["dir"] / "dist", qwen3_dir)
    assert sorted(state) == sorted(tp2["hf_step1"])
    assert "model.layers.1.self_attn.k_norm.weight" in state
    for k, v in tp2["hf_step1"].items():
        assert torch.equal(state[k], v), k


def test_qwen3_tp2_step_equals_the_single_rank_step(qwen3_dir, tp2):
    assert tp2["tp_size"] == 2 and tp2["roundtrip_exact"]
    mbs = mc.micro_batches()
    backend = mc.in_process_backend(qwen3_dir)
    be = next(backend)
    try:
        torch.testing.assert_close(mc.logps(be, mbs), tp2["logp_initial"], atol=2e-5, rtol=1e-5)
        r = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
        grads = {n: p.grad for n, p in be._module().named_parameters()}
        qk = [n for n in tp2["replicated_grads"] if "q_layernorm" in n or "k_layernorm" in n]
        assert len(qk) == 4   # 2 layers x (q, k)
        for name, g in tp2["replicated_grads"].items():
            torch.testing.assert_close(g, grads[name], atol=1e-6, rtol=1e-5, msg=name)
        assert r.stats["loss"] == pytest.approx(tp2["loss"], rel=1e-5, abs=1e-6)
        assert r.grad_norm == pytest.approx(tp2["grad_norm"], rel=1e-5)
        torch.testing.assert_close(mc.logps(be, mbs), tp2["logp_step1"], atol=1e-4, rtol=1e-4)
    finally:
        next(backend, None)   # closes it (Megatron's process groups are per process)
