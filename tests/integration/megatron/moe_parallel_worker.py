"""One rank of the 2-process MoE jobs of test_megatron_moe_parallel.py (gloo, CPU).

`MODEL OUT AUX LAYOUT`: the Megatron backend on MODEL, router load-balancing and z-losses at
coefficient AUX, LAYOUT `ep2` (TP=1, EP=2, so data parallel 2: each rank its own micro-batches,
the experts split 2 + 2), `tp2` (TP=2: both ranks all the micro-batches, every expert split over
the two) or `pp2` (PP=2: one layer, its router and experts, on each stage); records the HF round trip, this rank's log-probs (its empty micro-batch
included), one training step (loss, gradient norm, every gradient after the data-parallel sums),
the step's routing metrics, the HF tensors after it, and a dist checkpoint in OUT/dist; each rank
writes OUT/ep2.rank<r>.pt. Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    model_dir, out, aux, layout = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))   # megatron_case
    import megatron_case as mc
    import megatron_moe_case as mm
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ep, tp, pp = {"ep2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}[layout]
    be = MegatronBackend(mm.moe_trainer_cfg(ep=ep, tp=tp, aux=aux, z=aux, pp=pp), model_dir, seed=0)
    rank = dist.get_rank()
    everything = mm.ep2_micro_batches()
    mbs = everything[be.dp_rank] if layout == "ep2" else [mb for part in everything for mb in part]
    total_valid = sum(mc.n_valid(m) for m in everything)
    original = load_file(str(model_dir / "model.safetensors"))
    exported = be.hf_state()
    res = {"ep_size": be.ep_size, "tp_size": be.tp_size, "pp_size": be.pp_size, "dp_rank": be.dp_rank,
           "ep_rank": be.ep_rank,
           "roundtrip_exact": sorted(exported) == sorted(original)
           and all(torch.equal(exported[k], original[k]) for k in original),
           "logp_initial": [be.forward_logprobs(mb, 1.0).logp for mb in mbs]}
    r = be.train_step(mbs, mc.make_loss_fn(total_valid), 1.0)
    res |= {"grad_norm": r.grad_norm, "loss": r.stats.get("loss", 0.0),
            "grads": {n: p.grad.clone() for n, p in be._module().named_parameters() if p.grad is not None},
            "metrics": be.step_metrics(), "hf_step1": be.hf_state()}
    be.save_checkpoint(out / "dist")
    torch.save(res, out / f"ep2.rank{rank}.pt")
    be.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
