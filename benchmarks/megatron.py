"""Megatron-core backend on CPU: one train step and one proximal forward per parallel layout.

The tiny model (`rollout.tiny_model`: 4 layers, hidden 128), 8 sequences of 40-120 tokens
(seeded) in 2 packed micro-batches, one torch thread per rank, gloo between ranks. Layouts: TP=1
in one process, TP=2 and PP=2 in two processes each (real `torch.distributed` jobs, started as
`python -m benchmarks.megatron --rank ...`). Each rank builds the backend (timed: mostly
importing megatron-core and transformers), takes one warm-up step, then times `train_step`
(forward + backward + AdamW over both micro-batches) and the proximal forward (log-probs of both
micro-batches) several times; the medians are reported. On two cores model parallelism cannot be
faster than one process: the TP/PP rows show what the communication costs.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

LAYOUTS = [("TP=1", 1, 1), ("TP=2", 2, 1), ("PP=2", 1, 2)]   # (name, tensor, pipeline parallel)
N_SEQS, MIN_LEN, MAX_LEN, N_MICRO_BATCHES = 8, 40, 120, 2
WORKER_FLAG = "--rank"
CHECKOUT = Path(__file__).resolve().parents[1]


def micro_batches(vocab: int, seed: int = 0) -> list:
    """N_SEQS seeded sequences dealt round-robin into packed micro-batches with advantages."""
    import torch

    from tandem.trainer.backend import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=gen)),),
                          generator=gen) for _ in range(N_SEQS)]
    out = []
    for m in range(N_MICRO_BATCHES):
        part = seqs[m::N_MICRO_BATCHES]
        lens = [len(s) for s in part]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        n = int(cu[-1])
        mask = torch.ones(n, dtype=torch.bool)
        mask[cu[:-1].long()] = False          # a sequence's first token has no prediction
        out.append(PackedBatch(input_ids=torch.cat(part), position_ids=torch.cat([torch.arange(k) for k in lens]),
                               cu_seqlens=cu, fields={"adv": torch.randn(n, generator=gen), "loss_mask": mask}))
    return out


def worker(tp: int, pp: int, model_dir: Path, steps: int, out: Path) -> int:
    """One rank: build the backend, warm up, time train steps and proximal forwards."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist

    from tandem.services.protocol import collectives
    from tandem.trainer.config import TrainerConfig
    from tandem.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    backend = MegatronBackend(TrainerConfig(backend="megatron", tensor_parallel=tp, pipeline_parallel=pp),
                              model_dir, seed=0)
    build_s = time.perf_counter() - t0
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    mbs = micro_batches(vocab)
    valid = float(sum(int(mb.fields["loss_mask"].sum()) for mb in mbs))

    def loss_fn(mb, o):
        mask = mb.fields["loss_mask"]
        loss = -(mb.fields["adv"] * o.logp * mask).sum() / valid
        return loss, {"loss": loss.detach()}   # read once per step, as the training loop's are

    def barrier() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            collectives.barrier()

    backend.train_step(mbs, loss_fn, 1.0)            # warm-up
    train, forward = [], []
    for _ in range(steps):
        barrier()
        t = time.perf_counter()
        backend.train_step(mbs, loss_fn, 1.0)
        barrier()
        train.append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            for mb in mbs:
                backend.forward_logprobs(mb, 1.0)
        barrier()
        forward.append(time.perf_counter() - t)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps({"build_s": build_s, "train_step_s": statistics.median(train),
                                   "proximal_forward_s": statistics.median(forward),
                                   "tokens": sum(mb.n_tokens for mb in mbs), "padded_vocab": backend.padded_vocab}))
    backend.close()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(tp: int, pp: int, model_dir: Path, steps: int, out: Path) -> dict:
    """Start the layout's ranks as processes and wait for them; rank 0's timings."""
    world = tp * pp
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.megatron", WORKER_FLAG, str(tp), str(pp),
                                       str(model_dir), str(steps), str(out)], env=env, cwd=CHECKOUT))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"TP={tp} PP={pp}: rank exit codes {codes} (their output is above)")
    return json.loads(out.read_text())


def main(quick: bool = False) -> dict:
    from tandem.rollout.tiny_model import init_tiny

    steps = 2 if quick else 10
    rows, headline = [], {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-megatron-") as tmp:
        model_dir = Path(tmp) / "tiny"
        init_tiny(model_dir, seed=0)
        for name, tp, pp in LAYOUTS:
            r = run_layout(tp, pp, model_dir, steps, Path(tmp) / f"{name}.json")
            key = name.replace("=", "").lower()           # tp1, tp2, pp2
            tokens_per_s = r["tokens"] / r["train_step_s"]
            rows.append([name, tp * pp, r["train_step_s"] * 1e3, tokens_per_s,
                         r["proximal_forward_s"] * 1e3, r["build_s"]])
            headline |= {f"train_step_ms@{key}": round(r["train_step_s"] * 1e3, 1),
                         f"train_tokens_per_s@{key}": round(tokens_per_s),
                         f"proximal_forward_ms@{key}": round(r["proximal_forward_s"] * 1e3, 1),
                         f"build_s@{key}": round(r["build_s"], 2)}
            headline["tokens"] = r["tokens"]
    print_table(f"Megatron-core backend on CPU: tiny model, {headline['tokens']} tokens in "
                f"{N_MICRO_BATCHES} micro-batches, 1 thread per rank, median of {steps}",
                ["layout", "processes", "train step ms", "train tokens/s", "proximal forward ms", "build s"], rows)
    if not quick:
        write_results("megatron", headline)
    return headline


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        tp_, pp_, model_, steps_, out_ = sys.argv[2:7]
        sys.exit(worker(int(tp_), int(pp_), Path(model_), int(steps_), Path(out_)))
    cli(main)
