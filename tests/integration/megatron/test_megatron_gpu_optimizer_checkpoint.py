"""The Megatron dist checkpoint has one format for the CPU path and both GPU optimizers (issue 31).

The H200 run never wrote a Megatron checkpoint (both optimizers failed in Megatron's
`sharded_state_dict`, see tests/unit/megatron/test_megatron_gpu_checkpoint.py). Going on from
there on CPU showed two more defects: megatron-core 0.16.1's distributed optimizer with torch's
AdamW (no TE/Apex, as on the H200) could not load its own 'fully_reshardable' checkpoint into a
fresh optimizer (`assert len(steps) == 1`, then `KeyError: 'step'`), and the optimizer part of
the checkpoint differed between the CPU path, the Float16 optimizer and the distributed one, so
a checkpoint resumed only on the device and optimizer that wrote it. The backend now saves the
optimizer state in model space (trainer/megatron/optim_state.py). Here the backend's own
`dist_ckpt.save` / `dist_ckpt.load` write and read real dist checkpoints (writer processes) with
each writer/reader pair: the CPU path (torch AdamW, fp32) and the GPU path's bf16 model with
`Float16OptimizerWithFloat16Params` or `DistributedOptimizer`; the reader gets the writer's fp32
main weights, Adam moments and update count, and parameters equal to those main weights in its
own dtype (a bf16 writer's fp32 main weights, not their rounding, become a CPU reader's weights).
A two-rank job (gpu_optimizer_dp_worker.py) spreads the distributed optimizer's state over two
DP ranks, and its checkpoint resumes at one.

Megatron's GPU optimizers run on CPU tensors with CUDA type names and placement stood in
(tests/support/megatron_gpu_on_cpu.py): they cannot be constructed here otherwise.
"""
from __future__ import annotations

import megatron_case as mc
import pytest
import torch
from megatron_gpu_on_cpu import bf16_model, cuda_on_cpu, gpu_optimizer
from rank_processes import rank_errors, reap, start_ranks

from tandem.trainer.megatron import dist_ckpt, gpu, optim_state

pytestmark = pytest.mark.timeout(300)
SIDES = ("cpu", "float16", "distributed")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    yield from mc.in_process_backend(mc.make_model_dir(tmp_path_factory.mktemp("qwen2")))


class Side:
    """The backend's model and optimizer for one side: its own CPU ones, or a GPU-path pair."""

    def __init__(self, backend, kind: str, seed: int):
        self.backend, self.kind = backend, kind
        self.cpu = (backend.model, backend.optimizer, backend.on_gpu, backend.updates, backend.params)
        if kind == "cpu":
            self.model, self.opt = backend._module(), backend.optimizer
            return
        self.model, config = bf16_model(backend, seed=seed)
        self.ddp, self.opt = gpu_optimizer(backend, self.model, config, distributed=kind == "distributed")

    def __enter__(self):
        b = self.backend
        if self.kind != "cpu":
            b.model, b.optimizer, b.on_gpu = self.ddp, self.opt, True
            b.params = [p for p in self.model.parameters() if p.requires_grad]
        return self

    def __exit__(self, *exc):
        b = self.backend
        b.model, b.optimizer, b.on_gpu, b.updates, b.params = self.cpu

    def train(self, steps: int) -> None:
        b, gen = self.backend, torch.Generator().manual_seed(7)
        for _ in range(steps):
            if self.kind == "cpu":
                mbs = mc.micro_batches()
                assert b.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0).applied
                continue
            with cuda_on_cpu():
                gpu.zero_grad(self.ddp, self.opt)
                for p in self.ddp.parameters():
                    p.main_grad.copy_(torch.randn(p.shape, generator=gen))
                assert gpu.step(self.ddp, self.opt, lr=1e-2)[0]
                b.updates += 1

    def snapshot(self) -> dict:
        state = optim_state.read(self.model, self.opt)
        return {"state": state, "params": {n: p.detach().clone() for n, p in self.model.named_parameters()}}


@pytest.mark.parametrize("writer,reader", [(w, r) for w in SIDES for r in SIDES if "cpu" in (w, r) or w == r]
                         + [("float16", "distributed"), ("distributed", "float16")])
def test_a_checkpoint_resumes_with_any_optimizer_on_any_device(backend, tmp_path, writer, reader):
    backend.updates = 0
    with Side(backend, writer, seed=0) as w:
        w.train(2)
        with cuda_on_cpu():
            dist_ckpt.save(backend, tmp_path / "dist")
        before = w.snapshot()
    if reader == "cpu":   # the CPU side's own model: give it other weights, the load must replace them
        with torch.no_grad():
            for p in backend._module().parameters():
                p.add_(1.0)
    with Side(backend, reader, seed=5) as r:
        with cuda_on_cpu():
            dist_ckpt.load(backend, tmp_path / "dist")
        assert backend.updates == 2
        after = r.snapshot()
        steps = {float(s["step"]) for o in getattr(r.opt, "chained_optimizers", [r.opt])
                 for s in getattr(o, "optimizer", o).state.values()}
    assert steps == {2.0}
    for name, entry in before["state"].items():
        for kind, t in entry.items():
            assert torch.equal(after["state"][name][kind], t), (kind, name)
        # parameters: the writer's fp32 main weight in the reader's dtype (bf16: its rounding)
        dtype = after["params"][name].dtype
        assert torch.equal(after["params"][name], entry["param"].to(dtype)), name


def test_distributed_optimizer_state_spread_over_two_dp_ranks_resumes_at_one(backend, tmp_path):
    """Two real ranks (gloo) each hold a different range of every parameter's main weight and
    moments (gpu_optimizer_dp_worker.py); `optim_state.read` rebuilds the full tensors on both,
    and their DP=2 checkpoint resumes in this single CPU process with exactly those values."""

    from gpu_optimizer_dp_worker import expected


    procs, logs = start_ranks(["-m", "gpu_optimizer_dp_worker", str(backend.model_dir), str(tmp_path)], tmp_path,
                              "dp")
    try:
        errors = rank_errors(procs, logs)
    finally:
        reap(procs)
    assert not errors, "\n----\n".join(errors)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert all(r["rebuilt"] for r in ranks)
    assert all(0 < r["local_numel"] < r["total_numel"] for r in ranks)          # each holds a part
    assert sum(r["local_numel"] for r in ranks) == ranks[0]["total_numel"]     # and the parts add up

    backend.updates = 0
    dist_ckpt.load(backend, tmp_path / "dist")
    assert backend.updates == 3
    got = optim_state.read(backend._module(), backend.optimizer)
    for n in got:
        for kind in optim_state.KINDS:
            assert torch.equal(got[n][kind], expected(n, kind, got[n][kind].shape)), (kind, n)
    assert {float(s["step"]) for s in backend.optimizer.state.values()} == {3.0}
