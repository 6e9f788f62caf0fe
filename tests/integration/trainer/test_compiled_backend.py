"""trainer.compile with Inductor itself (trainer/compiled.py): the generated kernels (C++ here,
built by compiler processes, hence this tier; Triton on a GPU) train as the eager backend does,
its gradients within float32 rounding, and a pack of another shape runs them without compiling
again. The training pass only: each further graph (the no-gradient forward) costs this machine
half a minute of C++ compilation, and tests/unit/trainer/test_trainer_compile.py checks every
pass's graphs, run as captured, against eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.microbatch import pack
from trainer.torch_backend import TorchBackend

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
