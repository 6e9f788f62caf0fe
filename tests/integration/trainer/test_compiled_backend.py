"""trainer.compile with Inductor itself (trainer/compiled.py): the generated kernels (C++ here,
built by compiler processes, hence this tier; Triton on a GPU) train as the eager backend does,
its gradients within float32 rounding, and a pack of another shape runs them without compiling
again. The training pass only: each further graph (the no-gradient forward) costs this machine
half a minute of C++ compilation, and tests/integration/trainer/test_trainer_compile.py checks every
pass's graphs, run as captured, against eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.trainer.config import TrainerConfig
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(600)


def packs(seed: int, *counts: int) -> list:
    rng = np.random.default_rng(seed)
    return [pack([rng.integers(7, 200, int(k)) for k in rng.integers(2, 30, n)]) for n in counts]


def gradients(be, mbs) -> tuple[dict[str, torch.Tensor], float]:
    """The step's gradients where the optimizer reads them; the weights are left as they were."""
    total = float(sum(mb.n_tokens for mb in mbs))
    seen = {}
    real_step = be.optimizer.step
    be.optimizer.step = lambda *a, **k: seen.update({n: p.grad.clone() for n, p in be.model.named_parameters()})
    try:
        res = be.train_step(mbs, lambda _, out: (-out.logp.sum() / total, {}), 1.0)
    finally:
        be.optimizer.step = real_step
    return seen, res.grad_norm


def test_inductor_kernels_train_as_eager_and_serve_new_shapes(small_model_dir):
    torch._dynamo.reset()
    eager = TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), small_model_dir, 0)
    comp = TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0, compile=True), small_model_dir, 0)
    for seed, counts in ((0, (5, 3)), (1, (7, 2))):
        mbs = packs(seed, *counts)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):   # the second pack: no new graph
            (ge, ne), (gc, nc) = gradients(eager, mbs), gradients(comp, mbs)
        assert ge.keys() == gc.keys() and nc == pytest.approx(ne, rel=1e-4) and ne > 0
        for name, g in ge.items():
            assert torch.allclose(g, gc[name], rtol=1e-3, atol=1e-6), name
    torch._dynamo.reset()


def _megatron_step(model_dir, monkeypatch, compile: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(log-probs, gradients of one update, calls of megatron-core's fused SwiGLU) of a fresh
    in-process Megatron backend (one rank, float32 on the CPU)."""
    import dataclasses

    import megatron_case as mc
    from megatron.core.transformer import mlp

    fused = []
    real = mlp.bias_swiglu_impl
    monkeypatch.setattr(mlp, "bias_swiglu_impl", lambda *a, **k: fused.append(1) or real(*a, **k))
    monkeypatch.setattr(mc, "trainer_cfg", lambda *a, _real=mc.trainer_cfg, **k: dataclasses.replace(
        _real(*a, **k), compile=compile))
    gen = mc.in_process_backend(model_dir)
    be = next(gen)
    try:
        assert (be.chunk_fn is not None) == compile
        mbs = mc.micro_batches(seed=1)
        logp = torch.cat([be.forward_logprobs(mb, 0.8, with_entropy=True).logp for mb in mbs])
        grads = {}
        real_step = be.optimizer.step
        be.optimizer.step = lambda *a, **k: grads.update(
            {n: p.grad.clone() for n, p in be._module().named_parameters() if p.grad is not None})
        be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 0.8)
        be.optimizer.step = real_step
        return logp, grads, len(fused)
    finally:
        gen.close()


def test_megatron_with_compile_runs_megatrons_fused_swiglu_as_eager(tmp_path, monkeypatch):
    """The Megatron backend's trainer.compile: megatron-core's SwiGLU autograd function with its
    kernels under torch.compile (Inductor's C++ here), and the compiled log-prob chunks; the
    log-probs and the gradients of one update within float32 rounding of eager's."""
    import megatron_case as mc

    torch._dynamo.reset()
    model_dir = mc.make_model_dir(tmp_path / "qwen2", tied=False)
    logp_e, grads_e, fused_e = _megatron_step(model_dir, monkeypatch, compile=False)
    logp_c, grads_c, fused_c = _megatron_step(model_dir, monkeypatch, compile=True)
    assert fused_e == 0 and fused_c > 0    # both layers, in every pass
    torch.testing.assert_close(logp_c, logp_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-3, atol=1e-6, msg=name)
    torch._dynamo.reset()
