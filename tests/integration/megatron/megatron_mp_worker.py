"""One rank of the 2-process tensor-parallel job driven by test_megatron_backend.py.

Run as `python -m` (tests/support/rank_processes.start_ranks) with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set (gloo, CPU).
`train MODEL OUT`: TP=2 round trip, two training steps with a dist checkpoint in between, an HF
export, then a third step that blocks before its backward pass (the test SIGKILLs it there).
`resume MODEL OUT`: load the checkpoint and redo step two; then, in the same processes, rebuild
the backend as TP=1 x DP=2 and take one step with the micro-batches split over the two ranks;
then as PP=2 (one layer per stage) and take the same step through the pipeline.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    mode, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))   # megatron_case
    import megatron_case as mc
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    be = MegatronBackend(mc.trainer_cfg(tp=2), model_dir, seed=0)
    mbs = mc.micro_batches()
    loss_fn = mc.make_loss_fn(mc.n_valid(mbs))
    res: dict = {"tp_size": be.tp_size, "dp_size": be.dp_size}

    def step(name: str) -> None:
        r = be.train_step(mbs, loss_fn, 1.0)
        res[name] = {"grad_norm": r.grad_norm, "lr": r.lr, "stats": r.stats}
        res[f"logp_{name}"] = mc.logps(be, mbs)

    if mode == "train":
        original = load_file(str(model_dir / "model.safetensors"))
        exported = be.hf_state()
        res["roundtrip_keys_equal"] = sorted(exported) == sorted(original)
        res["roundtrip_exact"] = all(torch.equal(exported[k], original[k]) for k in original if k in exported)
        res["logp_initial"] = mc.logps(be, mbs)
        step("step1")
        be.export_hf(out / "hf_step1")
        be.save_checkpoint(out / "ckpt")
        step("step2")
        res["params_step2"] = be.hf_state()
        if rank == 0:
            torch.save(res, out / "train.pt")
        dist.barrier()

        def park():
            (out / f"in_step3.rank{rank}").touch()
            time.sleep(600)

        be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs), before_backward=park), 1.0)
        return 1  # never reached: the test kills this process mid-step
    if mode == "resume":
        be.load_checkpoint(out / "ckpt")
        step("step2")
        res["params_step2"] = be.hf_state()
        # Same processes, new layout: TP=1 x DP=2, each rank trains on its own micro-batch with
        # the loss normalised by the global token count (the loop's contract).
        be.close()
        be = MegatronBackend(mc.trainer_cfg(tp=1), model_dir, seed=0)
        res["dp"] = {"tp_size": be.tp_size, "dp_size": be.dp_size, "dp_rank": be.dp_rank}
        r = be.train_step([mbs[be.dp_rank]], loss_fn, 1.0)
        sums = torch.tensor([r.stats["loss"], r.stats["valid"]], dtype=torch.float64)
        dist.all_reduce(sums)
        res["dp"] |= {"grad_norm": r.grad_norm, "loss": float(sums[0]), "valid": float(sums[1]),
                      "logp": mc.logps(be, mbs)}
        # And PP=2: one layer per stage, tied embeddings split between the two stages.
        be.close()
        be = MegatronBackend(mc.trainer_cfg(tp=1, pp=2), model_dir, seed=0)
        original = load_file(str(model_dir / "model.safetensors"))
        exported = be.hf_state()
        res["pp"] = {"pp_size": be.pp_size, "first_stage": be.first_stage,
                     "roundtrip_exact": sorted(exported) == sorted(original)
                     and all(torch.equal(exported[k], original[k]) for k in original),
                     "logp_initial": mc.logps(be, mbs)}
        r = be.train_step(mbs, loss_fn, 1.0)
        sums = torch.tensor([r.stats.get("loss", 0.0), r.stats.get("valid", 0.0)], dtype=torch.float64)
        dist.all_reduce(sums)
        res["pp"] |= {"grad_norm": r.grad_norm, "loss": float(sums[0]), "valid": float(sums[1]),
                      "logp_step1": mc.logps(be, mbs)}
        if rank == 0:
            torch.save(res, out / "resume.pt")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
