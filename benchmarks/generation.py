"""Embedded generation server: output tokens/s at 1, 8 and 32 concurrent requests (continuous
batching must scale), and the latency of one pause -> update_weights_from_disk -> continue cycle.

The server runs as a real `tandem gen serve` subprocess with the tiny model; requests go through
the rollout client (`rollout.client.GenerationClient`), as in a run.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.common import cli, print_table, write_results
from tandem.rollout.client import GenerationClient
from tandem.rollout.tiny_model import init_tiny

PROMPT = [1, 5, 20, 21, 22, 23, 24, 25, 6]


def start_server(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "gen", "serve", "--model", str(model),
                             "--port", "0", "--threads", str(threads), "--max-running", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("serving on "):
            return proc, line.split()[-1]
    raise RuntimeError("the generation server did not start")


async def throughput(url: str, concurrency: int, seconds: float, new_tokens: int) -> float:
    """Closed loop: `concurrency` clients each keep one request in flight for `seconds`."""
    tokens = 0
    async with GenerationClient([url]) as client:
        deadline = time.perf_counter() + seconds
        t0 = time.perf_counter()

        async def worker(i: int) -> None:
            nonlocal tokens
            while time.perf_counter() < deadline:
                res = await client.generate(PROMPT + [30 + i % 50], {"max_new_tokens": new_tokens,
                                                                     "ignore_eos": True, "temperature": 1.0})
                tokens += len(res.output_ids)
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return tokens / (time.perf_counter() - t0)


async def interrupt_cycles(url: str, models: list[Path], cycles: int) -> list[float]:
    """pause(abort) -> update_weights_from_disk -> continue, while 8 requests are generating."""
    out = []
    async with GenerationClient([url]) as client, aiohttp.ClientSession() as http:
        load = [asyncio.ensure_future(client.generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
                for _ in range(8)]
        await asyncio.sleep(0.5)
        for i in range(cycles):
            t0 = time.perf_counter()
            for path, body in (("/pause_generation", {"mode": "abort"}),
                               ("/update_weights_from_disk", {"model_path": str(models[(i + 1) % 2]),
                                                              "weight_version": str(i + 1)}),
                               ("/continue_generation", {})):
                async with http.post(url + path, json=body) as resp:
                    assert resp.status == 200, await resp.text()
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.3)
        results = await asyncio.gather(*load)
        assert all(len(r.output_ids) == 400 for r in results)
    return out


def main(quick: bool = False) -> dict:
    # One torch thread: the client shares the two cores, and spinning OpenMP threads on an
    # oversubscribed machine cost far more than the second thread gains.
    threads = int(os.environ.get("TANDEM_BENCH_THREADS", "1"))
    seconds, new_tokens, cycles = (1.0, 32, 2) if quick else (8.0, 128, 5)
    with tempfile.TemporaryDirectory() as tmp:
        models = [init_tiny(Path(tmp) / "v0", seed=0), init_tiny(Path(tmp) / "v1", seed=1)]
        proc, url = start_server(models[0], threads)
        try:
            rates = {c: asyncio.run(throughput(url, c, seconds, new_tokens)) for c in (1, 8, 32)}
            cycle = asyncio.run(interrupt_cycles(url, models, cycles))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print_table(f"embedded generation server (tiny model, {threads} torch threads, {new_tokens}-token requests)",
                ["measure", "value"],
                [[f"output tokens/s @{c} concurrent", r] for c, r in rates.items()]
                + [["speed-up @32 vs @1", rates[32] / rates[1]],
                   ["pause -> update -> continue, median (s)", statistics.median(cycle)],
                   ["pause -> update -> continue, max (s)", max(cycle)]])
    headline = {"tokens_per_s@1": round(rates[1], 1), "tokens_per_s@8": round(rates[8], 1),
                "tokens_per_s@32": round(rates[32], 1), "interrupt_cycle_s": round(statistics.median(cycle), 4),
                "threads": threads}
    if not quick:
        write_results("generation", headline)
    return headline


if __name__ == "__main__":
    cli(main)
