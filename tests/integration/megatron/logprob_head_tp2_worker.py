"""One rank of the 2-process TP=2 job of test_megatron_logprob_head_tp2.py (gloo, CPU).

`OUT MODEL:MULTIPLE ...`: for each model directory and `trainer.megatron.vocab_multiple`, build
the backend at TP=2 and run logprob_head_case.compare (the vocabulary-parallel path against the
gathered-logits rows path, values, gradients and the widest vocabulary tensor); rank r writes
OUT/rank{r}.pt with one result per case. Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
    import logprob_head_case as lc
    import megatron_case as mc
    import torch
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for case in sys.argv[2:]:
        model_dir, multiple = case.rsplit(":", 1)
        cfg = mc.trainer_cfg(tp=2)
        cfg.megatron.vocab_multiple = int(multiple)
        be = MegatronBackend(cfg, Path(model_dir), seed=0)
        results[case] = lc.compare(be)
        be.close()
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
