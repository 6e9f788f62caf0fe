"""Dynamic micro-batching vs fixed batching on long-tailed lengths, and what it buys in training.

1. Allocation (shared/BASELINES.md lengths: lognormal(ln 2000, 1), seed 20240607, clipped to
   [64, 32768]; capacity 32,768 tokens): micro-batch count and balance of trainer.microbatch
   against the volume lower bound, a fixed count of sequences per micro-batch, and greedy padded
   batching in arrival order; the allocation time for 8,192 sequences (reference: 154 ms in
   pure Python for AReaL's first-fit-decreasing).
2. Training throughput: forward + backward of the tiny model (the embedded default's shape) on
   long-tailed lengths scaled to its context, packed into dynamic micro-batches vs padded
   batches under the same token budget; tokens/s counts real (non-pad) tokens only.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import math
import statistics
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import cli, print_table, write_results
from tandem.trainer.microbatch import allocate, allocate_for_ranks, pack

CAPACITY = 32768


def baseline_lengths(n: int, seed: int = 20240607, median: float = 2000, lo: int = 64, hi: int = 32768):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=math.log(median), sigma=1.0, size=n), lo, hi).astype(int).tolist()


def padded_greedy(lengths: list[int], cap: int) -> list[list[int]]:
    """Arrival order; a batch grows while (sequences x longest) stays within the budget."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > cap:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def padding_waste(lengths: list[int], batches: list[list[int]]) -> float:
    real = sum(lengths)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - real / padded


def allocation(n: int, repeats: int) -> dict:
    lengths = baseline_lengths(n)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bins = allocate_for_ranks(lengths, CAPACITY, 1)[0]
        times.append((time.perf_counter() - t0) * 1e3)
    loads = [sum(lengths[i] for i in b) for b in bins]
    greedy = padded_greedy(lengths, CAPACITY)
    fixed_count = max(1, CAPACITY // max(lengths))    # sequences per micro-batch that always fit
    return {"n": n, "lower_bound": math.ceil(sum(lengths) / CAPACITY), "dynamic": len(bins),
            "least_filled": min(loads), "alloc_ms": statistics.median(times),
            "fixed_count": math.ceil(n / fixed_count), "greedy_padded": len(greedy),
            "greedy_padding_waste": padding_waste(lengths, greedy)}


def throughput(quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from tandem.rollout.tiny_model import init_tiny
    from tandem.trainer.config import TrainerConfig
    from tandem.trainer.torch_backend import TorchBackend

    budget = 2048
    n_seqs = 48 if quick else 384
    lengths = baseline_lengths(n_seqs, seed=1, median=60, lo=8, hi=480)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(7, 200, n) for n in lengths]
    with tempfile.TemporaryDirectory() as d:
        init_tiny(d, seed=0)
        # The trainer's packed path (varlen attention) and a plain padded model, same weights.
        backend = TorchBackend(TrainerConfig(temperature=1.0, max_staleness=0), d, seed=0)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()

    def run_packed() -> float:
        t0 = time.perf_counter()
        for b in allocate(lengths, budget):
            mb = pack([seqs[i] for i in b])
            out = backend._forward(mb, 1.0, with_entropy=False)
            (-out.logp.sum() / sum(lengths)).backward()
        return time.perf_counter() - t0

    def run_padded() -> float:
        t0 = time.perf_counter()
        for b in padded_greedy(lengths, budget):
            width = max(lengths[i] for i in b)
            ids = torch.zeros((len(b), width), dtype=torch.long)
            mask = torch.zeros((len(b), width), dtype=torch.long)
            for r, i in enumerate(b):
                ids[r, : lengths[i]] = torch.from_numpy(seqs[i])
                mask[r, : lengths[i]] = 1
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logp * mask[:, 1:]).sum() / sum(lengths)).backward()
        return time.perf_counter() - t0

    run_packed(), run_padded()    # warm-up
    reps = 1 if quick else 3
    packed = min(run_packed() for _ in range(reps))
    padded = min(run_padded() for _ in range(reps))
    tokens = sum(lengths)
    return {"tokens": tokens, "budget": budget, "packed_tokens_per_s": tokens / packed,
            "padded_tokens_per_s": tokens / padded, "packed_mbs": len(allocate(lengths, budget)),
            "padded_mbs": len(padded_greedy(lengths, budget)),
            "padded_waste": padding_waste(lengths, padded_greedy(lengths, budget)),
            "threads": torch.get_num_threads()}


def main(quick: bool = False) -> dict:
    big = allocation(8192, 3 if quick else 15)
    small = allocation(512, 3 if quick else 15)
    rows = [[f"{a['n']} seqs", a["lower_bound"], a["dynamic"], a["least_filled"], round(a["alloc_ms"], 2),
             a["fixed_count"], a["greedy_padded"], round(100 * a["greedy_padding_waste"], 1)] for a in (big, small)]
    print_table("micro-batch allocation, capacity 32,768 tokens (BASELINES lengths)",
                ["set", "lower bound", "dynamic", "least-filled", "alloc ms", "fixed count",
                 "greedy padded", "padding %"], rows)
    tp = throughput(quick)
    ratio = tp["packed_tokens_per_s"] / tp["padded_tokens_per_s"]
    print_table(f"tiny-model forward+backward, {tp['tokens']} tokens, budget {tp['budget']} tokens/mb, "
                f"{tp['threads']} threads", ["layout", "micro-batches", "tokens/s", "padding %"],
                [["packed (dynamic)", tp["packed_mbs"], round(tp["packed_tokens_per_s"]), 0.0],
                 ["padded (greedy)", tp["padded_mbs"], round(tp["padded_tokens_per_s"]),
                  round(100 * tp["padded_waste"], 1)],
                 ["packed / padded", "", round(ratio, 2), ""]])
    headline = {"microbatches_dynamic": big["dynamic"], "microbatches_lower_bound": big["lower_bound"],
                "microbatches_fixed": big["greedy_padded"], "microbatches_fixed_count": big["fixed_count"],
                "padding_waste_fixed": round(big["greedy_padding_waste"], 3),
                "least_filled_dynamic": big["least_filled"], "alloc_ms_8192_seqs": round(big["alloc_ms"], 2),
                "alloc_ms_512_seqs": round(small["alloc_ms"], 3),
                "packed_over_padded_tokens_per_s": round(ratio, 3),
                "packed_tokens_per_s": round(tp["packed_tokens_per_s"]),
                "padded_tokens_per_s": round(tp["padded_tokens_per_s"])}
    if not quick:
        write_results("trainer", headline)
    return headline


if __name__ == "__main__":
    cli(main)
