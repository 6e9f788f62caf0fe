"""Peak memory and time of the log-prob step, whole vs chunked (`trainer.logprob_chunk`, issue 37).

One forward and backward of `trainer.logprobs.token_logprobs` over bf16 logits of Qwen2.5's
vocabulary (151,936), with the entropy, as the training step runs it: once with the whole
micro-batch's float32 log-softmax (`chunk=0`, what both backends did before) and once per chunk
size. Each case runs in its own process; the figure is the process's peak resident memory above
what it held before the logits were made (on CUDA: `torch.cuda.max_memory_allocated`), over two
passes, the second timed.

Why these shapes: the issue's shape, 32K tokens, needs about 100 GB unchunked, more than this
machine has. The saving is set by tokens / chunk (the chunked pass keeps the bf16 logits and
their gradient, 4 bytes per token and vocabulary entry, plus one chunk's float32 copies), so the
CPU run takes 2,048 tokens with a chunk of 64 — the 32 : 1 ratio of 32,768 tokens at the
default chunk of 1,024 — and a few other chunk sizes; `--tokens` and `--device cuda` run the
real shape where a GPU is.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import subprocess
import sys
import time

from benchmarks.common import cli, print_table, write_results

VOCAB = 151_936


def one_case(tokens: int, vocab: int, chunk: int, device: str) -> dict:
    """Runs in a fresh process: peak bytes above the start, and seconds, of one forward+backward."""
    import resource

    import torch

    from trainer.logprobs import token_logprobs

    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(2):   # the first call also loads code and warms caches: the second is timed
        t0 = time.perf_counter()
        out = token_logprobs(logits, ids, cu, 1.0, True, False, chunk)
        out.logp.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        del out
        logits.grad = None
    seconds = seconds[-1]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens": tokens, "vocab": vocab, "chunk": chunk, "peak_bytes": peak - base, "seconds": seconds}


def _run(tokens: int, vocab: int, chunk: int, device: str) -> dict:
    code = ("import json, sys; from benchmarks.logprob_memory import one_case; "
            f"print(json.dumps(one_case({tokens}, {vocab}, {chunk}, {device!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"case chunk={chunk} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(quick: bool = False, tokens: int = 2048, device: str = "cpu",
         chunks: tuple[int, ...] = (64, 256, 1024)) -> dict:
    if quick:
        tokens, chunks = 256, (64,)
    vocab = 4096 if quick else VOCAB
    whole = _run(tokens, vocab, 0, device)
    cases = [_run(tokens, vocab, c, device) for c in chunks if c < tokens]
    gb = 1e9
    rows = [["whole (0)", whole["peak_bytes"] / gb, 1.0, whole["seconds"], 1.0]]
    rows += [[c["chunk"], c["peak_bytes"] / gb, c["peak_bytes"] / whole["peak_bytes"], c["seconds"],
              c["seconds"] / whole["seconds"]] for c in cases]
    print_table(f"log-prob forward+backward, {tokens} tokens x {vocab} vocabulary, bf16 logits ({device})",
                ["chunk", "peak GB", "peak / whole", "seconds", "time / whole"],
                [[r[0], round(r[1], 3), round(r[2], 3), round(r[3], 3), round(r[4], 2)] for r in rows])
    headline = {"tokens": tokens, "vocab": vocab, "device": device, "whole": whole, "chunked": cases,
                "peak_ratio": {str(c["chunk"]): round(c["peak_bytes"] / whole["peak_bytes"], 4) for c in cases}}
    if not quick:
        write_results("logprob_memory", headline)
    return headline


if __name__ == "__main__":
    cli(main)
