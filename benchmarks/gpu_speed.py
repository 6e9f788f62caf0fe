"""Trainer speed on one GPU: tokens/s, MFU and peak memory of both backends' own train step at
real shapes (issue 37), random weights, bf16, no TransformerEngine or flash-attn needed.

Precision as a run trains: the torch backend with `trainer.compute_dtype: bfloat16` (float32
weights and AdamW, bf16 products under autocast), Megatron with bf16 parameters and float32 main
weights (`trainer.megatron.params_dtype`). benchmarks/results/gpu_speed.json's torch figures
predate that: they were taken with bf16 parameters and AdamW.

Shapes: Qwen2.5-0.5B and Qwen2.5-1.5B, from their published config.json values (below), with
random weights (`AutoModelForCausalLM.from_config`, saved once per run). Each step trains two
micro-batches, each one packed row of `pack` tokens made of 1,024-token sequences, through the
backend's `train_step` with a policy-gradient loss over every token — what the training loop
runs, log-probs (chunked, trainer.logprob_chunk) and the optimizer step included. One warm-up
step, then `steps` timed steps (CUDA synchronised). `--lengths varied` draws each sequence's length
anew every step, as an RL batch has them: kernels that build a plan per shape (cuDNN attention)
pay for it there and not with equal lengths. `--compile` adds each backend with
`trainer.compile: true` (trainer/compiled.py) beside its eager row ("torch+compile",
"megatron+compile"); their `warmup_s` includes the compilation; `--backends` keeps only the rows named. `--profile` adds one step under torch's profiler
and keeps its busiest operators. Each configuration runs in its own process
(Megatron's process groups are per process); one that runs out of memory is recorded as such,
with the device's memory.

MFU = 6 x parameters x tokens/s / peak, the issue's formula: the dense matrix products of the
forward and backward passes (attention's own products not counted); peak = 989 TFLOP/s, the
dense bf16 figure of an H100 / H200 SXM (`--peak-tflops` for another device).

    python -m benchmarks.gpu_speed [--packs 8192 32768] [--shapes 0.5b 1.5b]   (a GPU)
    python -m benchmarks.gpu_speed --quick                                    (any machine: a tiny
                                                                               shape, checks the code)
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

SEQ_LEN = 1024
BACKENDS = ("torch", "torch+compile", "megatron", "megatron+compile")
PEAK_TFLOPS = 989.0
# Published config.json values (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B): the shapes, not the weights.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}


def make_model_dir(shape: str, out: Path) -> Path:
    """A Qwen2 directory of this shape with random weights (bf16), made once."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _varied_lengths(pack: int, seq_len: int, gen) -> list[int]:
    """Sequence lengths as RL makes them, each its own (uniform in [seq_len / 8, 2 seq_len)),
    filling `pack` tokens exactly: kernels that compile per shape pay here, not with equal ones."""
    import torch

    lengths: list[int] = []
    while sum(lengths) < pack:
        n = int(torch.randint(max(1, seq_len // 8), 2 * seq_len, (1,), generator=gen))
        lengths.append(min(n, pack - sum(lengths)))
    return lengths


def one_case(backend: str, model_dir: str, pack: int, steps: int, seq_len: int, profile: bool = False,
             varied: bool = False) -> dict:
    """Runs in a fresh process: the backend's train step on two micro-batches of `pack` tokens
    (`profile`: then one more step under torch's profiler, its busiest operators kept; `varied`:
    sequences of different lengths, new ones each step, instead of `seq_len` each)."""
    import torch

    from tandem.trainer.backend import PackedBatch
    from tandem.trainer.config import OptimConfig, TrainerConfig

    cuda = torch.cuda.is_available()
    optim = OptimConfig(lr=1e-6, warmup_steps=1)
    if backend in ("torch", "torch+compile"):   # as a run trains it: float32 weights, bf16 products on a GPU
        from tandem.trainer.torch_backend import TorchBackend
        be = TorchBackend(TrainerConfig(backend="torch", optim=optim, compute_dtype="bfloat16" if cuda else "float32",
                                        compile=backend == "torch+compile", max_tokens_per_mb=pack),
                          Path(model_dir), seed=0)
    else:
        from tandem.trainer.megatron.backend import MegatronBackend
        from tandem.trainer.megatron.config import MegatronConfig
        be = MegatronBackend(TrainerConfig(backend="megatron", optim=optim, compile=backend == "megatron+compile",
                                           max_tokens_per_mb=pack),
                             Path(model_dir), seed=0,
                             mcfg=MegatronConfig(params_dtype="bfloat16"))
    params = sum(p.numel() for p in be.model.parameters())
    vocab = be.shape.vocab_size if backend.startswith("megatron") else be.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def micro_batch() -> PackedBatch:
        n_seq = max(1, pack // seq_len)
        lengths = [pack // n_seq] * n_seq if not varied else _varied_lengths(pack, seq_len, gen)
        ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        fields = {"loss_mask": torch.ones(len(ids), dtype=torch.bool), "adv": torch.randn(len(ids), generator=gen)}
        return PackedBatch(ids, pos, cu, fields, list(range(n_seq)))

    mbs = [micro_batch(), micro_batch()]
    total = float(sum(mb.n_tokens for mb in mbs))

    def loss_fn(mb, out):
        loss = -(mb.fields["adv"] * out.logp * mb.fields["loss_mask"]).sum() / total
        return loss, {"loss": loss.detach()}   # read once per step, as the training loop's are

    record = {"backend": backend, "pack": pack, "lengths": "varied" if varied else "equal",
              "tokens_per_step": int(total), "parameters": params,
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              # trainer.recompute: auto decides by the pack and the device's memory (trainer/recompute.py)
              "recompute": be.recompute_choice.record()}
    try:
        t0 = time.perf_counter()
        be.train_step(mbs, loss_fn, 1.0)             # warm-up: allocations, kernels, optimizer state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        record["warmup_s"] = time.perf_counter() - t0   # torch+compile: the compilation's too
        t0 = time.perf_counter()
        for _ in range(steps):
            if varied:   # new lengths each step, as an RL run's batches have
                mbs = [micro_batch(), micro_batch()]
            be.train_step(mbs, loss_fn, 1.0)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / steps
    except torch.OutOfMemoryError as e:
        return {**record, "out_of_memory": True, "error": str(e).splitlines()[0][:300],
                "device_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}
    peak = torch.cuda.max_memory_allocated() if cuda else None
    out = {**record, "step_s": seconds, "tokens_per_s": total / seconds, "peak_bytes": peak}
    if profile:   # one more step under the profiler, after the timed ones: where a step's time goes
        out["top_kernels"] = _profiled_step(lambda: be.train_step(mbs, loss_fn, 1.0), cuda)
    return out


def _profiled_step(step, cuda: bool, top: int = 15) -> list[dict]:
    """The operators that took most device time (CPU time on a CPU) in one step: name, calls, ms."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
    busy = sum(getattr(e, attr, 0) for e in events) / 1e3
    # The first row: the step's wall time (under the profiler) against the time the operators
    # took; a device busy much less than the wall waits on the host (launches, synchronisation).
    return [{"op": "(whole step: wall ms, busy ms)", "calls": 1, "ms": round(wall * 1e3, 2), "busy_ms": round(busy, 2)}] + \
        [{"op": e.key[:80], "calls": e.count, "ms": round(getattr(e, attr, 0) / 1e3, 2)} for e in events[:top]]


def _run(backend: str, model_dir: Path, pack: int, steps: int, seq_len: int, profile: bool, varied: bool) -> dict:
    code = ("import json; from benchmarks.gpu_speed import one_case; print('RESULT ' + json.dumps("
            f"one_case({backend!r}, {str(model_dir)!r}, {pack}, {steps}, {seq_len}, {profile}, {varied})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"backend": backend, "pack": pack, "failed": (proc.stdout + proc.stderr)[-1500:]}
    return json.loads(lines[-1][len("RESULT "):])


def main(quick: bool = False, shapes: tuple[str, ...] = ("0.5b", "1.5b"), packs: tuple[int, ...] = (8192, 32768),
         steps: int = 3, peak_tflops: float = PEAK_TFLOPS, profile: bool = False, lengths: str = "equal",
         compile: bool = False, backends: tuple[str, ...] = ()) -> dict:
    seq_len = SEQ_LEN
    if quick:
        shapes, packs, steps, seq_len = ("tiny",), (256,), 1, 64
    rows, cases = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            model_dir = make_model_dir(shape, Path(tmp) / shape)
            for pack in packs:
                for backend in backends or (BACKENDS if compile else ("torch", "megatron")):
                    c = {"shape": shape, **_run(backend, model_dir, pack, steps, seq_len, profile, lengths == "varied")}
                    if "tokens_per_s" in c:
                        c["mfu"] = 6 * c["parameters"] * c["tokens_per_s"] / (peak_tflops * 1e12)
                    cases.append(c)
                    outcome = ("out of memory" if c.get("out_of_memory") else "failed" if "failed" in c
                               else f"{c['tokens_per_s']:,.0f}")
                    rows.append([shape, backend, pack, outcome, round(c["mfu"], 4) if "mfu" in c else None,
                                 round(c["peak_bytes"] / 1e9, 1) if c.get("peak_bytes") else None,
                                 "on" if (c.get("recompute") or {}).get("on") else "off"])
                    print(f"{shape} {backend} pack {pack}: {outcome} tokens/s, MFU {c.get('mfu')}, "
                          f"peak {c.get('peak_bytes')} B" + (f"\n{c['failed']}" if "failed" in c else ""), flush=True)
                    print("CASE " + json.dumps({k: v for k, v in c.items() if k != "top_kernels"}), flush=True)
                    for k in c.get("top_kernels", []):
                        print(f"    {k['ms']:9.2f} ms {k['calls']:6d}x  {k['op']} {k.get('busy_ms', '')}", flush=True)
    what = f"{seq_len}-token sequences" if lengths == "equal" else f"sequences of {seq_len // 8} to {2 * seq_len - 1} tokens, new each step"
    print_table(f"train step, bf16, two packed micro-batches of {what} "
                f"(MFU: 6 x params x tokens/s / {peak_tflops:g} TFLOP/s)",
                ["shape", "backend", "pack tokens", "tokens/s", "MFU", "peak GB", "recompute"], rows)
    headline = {"mfu_formula": f"6 * parameters * tokens_per_s / {peak_tflops:g}e12", "seq_len": seq_len, "lengths": lengths,
                "cases": cases}
    if not quick:
        write_results("gpu_speed", headline)
    return headline


def _args(p) -> list[str]:
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    p.add_argument("--packs", nargs="+", type=int, default=[8192, 32768], help="tokens per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the device's dense bf16 peak")
    p.add_argument("--profile", action="store_true", help="one more step per case under torch's profiler: "
                   "its busiest operators, printed and kept in the results")
    p.add_argument("--lengths", choices=["equal", "varied"], default="equal",
                   help=f"sequences of {SEQ_LEN} tokens each, or of lengths drawn anew each step (as in RL)")
    p.add_argument("--compile", action="store_true", help="also each backend with trainer.compile: true")
    p.add_argument("--backends", nargs="+", default=[], choices=BACKENDS,
                   help="only these rows (default: torch and megatron, and their +compile rows with --compile)")
    return ["shapes", "packs", "steps", "peak_tflops", "profile", "lengths", "compile", "backends"]


if __name__ == "__main__":
    cli(main, _args)
