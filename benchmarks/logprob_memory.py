"""Peak memory and time of the log-prob step: the whole pass, chunked rows, and the output layer
in chunks (`trainer.logprob_chunk`, issue 37).

One forward and backward of the training step's log-probs and entropies, from a micro-batch's
final hidden states [tokens, hidden] (bf16) and the output layer's weight [vocab, hidden]
(Qwen2.5's vocabulary, 151,936; Qwen2.5-1.5B's hidden size, 1,536), three ways:

- `whole`: logits made whole, then their float32 log-softmax whole — what both backends did
  before issue 37 ("today's" in the issue);
- `rows`: logits made whole, the log-softmax a chunk of rows at a time (`token_logprobs(logits,
  chunk=C)`: what the Megatron backend did before it took hidden states) — the model's bf16
  logits and their gradient stay;
- `head`: the output layer itself a chunk at a time (`token_logprobs(hidden, head=W, chunk=C)`:
  what the torch backend does, and the Megatron backend at TP = 1; at TP > 1 it runs the
  vocabulary-parallel form of trainer/megatron/logprob_head.py, not measured here) — nothing
  of a vocabulary's width outlives its chunk.

Each case runs in its own process; the figure is the peak memory above what the process held
once the hidden states and weight existed (on CUDA: `torch.cuda.max_memory_allocated`; on the CPU
the resident set), over two passes, the second timed. A case that does not fit is recorded as
out of memory with what the device has.

Why these shapes: the issue's shape, 32K tokens, needs about 100 GB for the whole pass, more than
this machine has. What chunking saves is set by tokens / chunk, so the CPU run takes 2,048 tokens
with chunks of 64 — the 32 : 1 ratio of 32,768 tokens at the default chunk of 1,024;
`--tokens 32768 --device cuda` runs the real shape where a GPU is.
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
HIDDEN = 1_536
MODES = ("whole", "rows", "head")


def one_case(tokens: int, vocab: int, hidden: int, chunk: int, mode: str, device: str) -> dict:
    """Runs in a fresh process: peak bytes above the start, and seconds, of one forward+backward."""
    import resource

    import torch

    from tandem.trainer.logprobs import token_logprobs

    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    # made in bf16 directly: a float32 temporary would raise the CPU's peak before it is read
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16).mul_(hidden ** -0.5).requires_grad_(True)
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "mode": mode, "chunk": 0 if mode == "whole" else chunk}
    seconds = []
    try:
        for _ in range(2):   # the first call also loads code and warms caches: the second is timed
            t0 = time.perf_counter()
            if mode == "head":
                out = token_logprobs(h, ids, cu, 1.0, True, False, chunk, head=w)
            else:
                out = token_logprobs(h @ w.T, ids, cu, 1.0, True, False, chunk if mode == "rows" else 0)
            out.logp.sum().backward()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            del out
            h.grad = w.grad = None
    except torch.OutOfMemoryError:
        total = torch.cuda.get_device_properties(0).total_memory if cuda else None
        return {**record, "peak_bytes": None, "seconds": None, "out_of_memory": True, "device_bytes": total}
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**record, "peak_bytes": peak - base, "seconds": seconds[-1]}


def _run(tokens: int, vocab: int, chunk: int, device: str, mode: str = "head", hidden: int = HIDDEN) -> dict:
    code = ("import json, sys; from benchmarks.logprob_memory import one_case; "
            f"print(json.dumps(one_case({tokens}, {vocab}, {hidden}, {chunk}, {mode!r}, {device!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"case {mode} chunk={chunk} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(case: dict, whole: dict) -> float | None:
    if case["peak_bytes"] is None or whole["peak_bytes"] is None:
        return None
    return round(case["peak_bytes"] / whole["peak_bytes"], 4)


def main(quick: bool = False, tokens: int = 2048, device: str = "cpu", chunks: tuple[int, ...] = (64, 1024)) -> dict:
    if quick:
        tokens, chunks = 256, (64,)
    vocab = 4096 if quick else VOCAB
    hidden = 64 if quick else HIDDEN
    whole = _run(tokens, vocab, 0, device, "whole", hidden)
    cases = [_run(tokens, vocab, c, device, mode, hidden) for c in chunks if c < tokens for mode in ("rows", "head")]
    gb = 1e9

    def row(c):
        if c["peak_bytes"] is None:
            return [c["mode"], c["chunk"], f"out of memory ({c['device_bytes'] / gb:.0f} GB)", None, None, None]
        return [c["mode"], c["chunk"], round(c["peak_bytes"] / gb, 3), _ratio(c, whole), round(c["seconds"], 3),
                round(c["seconds"] / whole["seconds"], 2) if whole["seconds"] else None]
    print_table(f"log-prob forward+backward from hidden states, {tokens} tokens x {vocab} vocabulary x {hidden} "
                f"hidden, bf16 ({device})", ["mode", "chunk", "peak GB", "peak / whole", "seconds", "time / whole"],
                [row(whole), *map(row, cases)])
    headline = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "device": device, "whole": whole, "chunked": cases,
                "peak_ratio": {f"{c['mode']}-{c['chunk']}": _ratio(c, whole) for c in cases}}
    if not quick:
        write_results("logprob_memory", headline)
    return headline


def _args(p) -> list[str]:
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default 2048)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    return ["tokens", "device"]


if __name__ == "__main__":
    cli(main, _args)
