"""One rank of a 2-rank data-parallel job with Megatron's DistributedOptimizer on CPU tensors.

Run as `python -m` (tests/support/rank_processes.start_ranks) with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (gloo): `MODEL OUT`. Each DP
rank holds a different range of every parameter's fp32 main weight and Adam moments; the
worker sets those ranges from known full tensors (a function of the parameter's name), checks
that `optim_state.read` rebuilds the full tensors on both ranks, and saves a dist checkpoint
through the backend's `dist_ckpt` (GPU branch) for the test to load at DP=1 on the CPU path.
No training step: gloo has no reduce-scatter, which the distributed optimizer's gradient
reduction uses. CUDA type names and placement are stood in (tests/support/megatron_gpu_on_cpu.py).
"""
from __future__ import annotations

import sys
from pathlib import Path


def expected(name: str, kind: str, shape):
    """The full tensor of `kind` for parameter `name` (torch.Tensor), the same in every process."""
    import hashlib

    import torch
    seed = int(hashlib.sha256(f"{kind}:{name}".encode()).hexdigest()[:12], 16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def main() -> int:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
    import megatron_case as mc
    import torch
    import torch.distributed as dist
    from megatron_gpu_on_cpu import bf16_model, cuda_on_cpu, gpu_optimizer

    from tandem.trainer.megatron import dist_ckpt, optim_state
    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    be = MegatronBackend(mc.trainer_cfg(tp=1), model_dir, seed=0)
    assert be.dp_size == 2
    model, config = bf16_model(be, seed=0)
    ddp, opt = gpu_optimizer(be, model, config, distributed=True)
    optim_state.init_state(opt, step=3)
    full = {n: {k: expected(n, k, p.shape) for k in optim_state.KINDS} for n, p in model.named_parameters()}
    held = optim_state.write(model, opt, full)
    got = optim_state.read(model, opt)
    ok = all(torch.equal(got[n][k], full[n][k]) for n in full for k in optim_state.KINDS)
    # this rank holds only part of the state: the parts of the two ranks are disjoint
    local = sum(t["exp_avg"].numel() for _, _, t, _, _ in optim_state._slots(model, opt) if t is not None)
    be.model, be.optimizer, be.on_gpu, be.updates = ddp, opt, True, 3
    with cuda_on_cpu():
        dist_ckpt.save(be, out / "dist")
    torch.save({"rebuilt": ok, "held": held, "local_numel": local,
                "total_numel": sum(p.numel() for p in model.parameters())}, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
