"""One case of the Megatron log-prob step's peak memory, in its own process (a fresh CUDA caching
allocator and fresh Megatron process groups), for test_gpu_megatron_logprob_memory.py.

    python tests/gpu/megatron_logprob_worker.py MODEL_DIR MODE TOKENS CHUNK OUT.json

MODE: `head` (the backend's path: trainer/megatron/logprob_head.py, the output layer a chunk of
tokens at a time), `rows` (the path it replaced: the output layer's whole logits, then the
float32 log-softmax in chunks of rows) or `whole` (`rows` with no chunks: both backends before
issue 37, "today's" in the issue). The step: from the last stage's final hidden states (made
first, detached, and counted in the base), log-probs and entropies (no entropy bonus: the
default step's), a loss of the log-probs, backward to the output weight and the hidden states. The figure is the CUDA peak above the base
(`torch.cuda.max_memory_allocated`); on the CPU (the tier's rehearsal) the resident set's.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1] / "support")]

import logprob_head_case as lc  # noqa: E402
import megatron_case as mc  # noqa: E402


def _bytes_now(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    model_dir, mode, tokens, chunk, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    cuda = torch.cuda.is_available()
    be = MegatronBackend(mc.trainer_cfg(tp=1, params_dtype="bfloat16"), model_dir, seed=0)
    be.cfg.logprob_chunk = 0 if mode == "whole" else chunk
    gen = torch.Generator().manual_seed(0)
    lens = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)]
    mb = mc.packed([torch.randint(0, be.shape.vocab_size, (n,), generator=gen) for n in lens], 0)
    with torch.no_grad():
        hidden = be._stage_forward(mb)
    hidden = hidden.detach().requires_grad_(True)
    record = {"mode": mode, "tokens": tokens, "chunk": be.cfg.logprob_chunk, "vocab": be.shape.vocab_size,
              "padded_vocab": be.padded_vocab, "hidden": be.shape.hidden_size, "dtype": str(hidden.dtype),
              "device": "cuda" if cuda else "cpu",
              "gpu": torch.cuda.get_device_name() if cuda else None}
    try:
        seconds = []
        for _ in range(2):   # the first pass also loads kernels: the second is timed
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = _bytes_now(cuda)
            t0 = time.perf_counter()
            lc.run_path(be, mb, mode != "head", hidden=hidden, entropy_grad=False)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            peak = (torch.cuda.max_memory_allocated() if cuda else _bytes_now(cuda)) - base
            hidden.grad = None
        record |= {"peak_bytes": peak, "seconds": seconds[-1]}
    except torch.OutOfMemoryError:
        record |= {"peak_bytes": None, "out_of_memory": True,
                   "device_bytes": torch.cuda.get_device_properties(0).total_memory}
    out.write_text(json.dumps(record))
    be.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
