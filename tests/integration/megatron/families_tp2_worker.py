"""One rank of the 2-process TP=2 job of test_megatron_families_tp2.py (gloo, CPU).

`MODEL OUT`: build the Megatron backend at TP=2 on MODEL, record the HF round trip, the
log-probs, one training step (gradient norm, loss, the gradients of every replicated tensor,
norms and Qwen3's q/k norms among them), the log-probs and HF tensors after it, and a dist
checkpoint in OUT/dist; rank 0 writes OUT/tp2.pt.
Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))   # megatron_case
    import megatron_case as mc
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tandem.trainer.megatron import convert
    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    be = MegatronBackend(mc.trainer_cfg(tp=2), model_dir, seed=0)
    mbs = mc.micro_batches()
    original = load_file(str(model_dir / "model.safetensors"))
    exported = be.hf_state()
    res = {"tp_size": be.tp_size,
           "roundtrip_exact": sorted(exported) == sorted(original)
           and all(torch.equal(exported[k], original[k]) for k in original),
           "logp_initial": mc.logps(be, mbs)}
    r = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    res |= {"grad_norm": r.grad_norm, "loss": r.stats.get("loss"), "logp_step1": mc.logps(be, mbs),
            "replicated_grads": {n: p.grad.clone() for n, p in be._module().named_parameters()
                                 if convert.tp_layout(n)[0] is None and p.grad is not None},
            "hf_step1": be.hf_state()}
    be.save_checkpoint(out / "dist")
    if dist.get_rank() == 0:
        torch.save(res, out / "tp2.pt")
    be.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
