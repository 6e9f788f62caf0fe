"""The GPU tier (`make test-gpu`, marker `gpu`): what only a CUDA device can show.

Everything collected under tests/gpu gets the `gpu` marker and is skipped, with the reason, where
torch sees no CUDA device — so `make test` on a CPU machine collects and skips it, and nothing
here has to remember to mark itself. `TANDEM_GPU_TIER_REHEARSAL=1` runs the tier on the CPU
instead: a rehearsal of the tests' own code (workers, comparisons, the launcher runs) before a
scarce GPU session, which proves nothing about GPUs — every result says `device: cpu`.

Each backend configuration runs in its own process (step_worker.py): Megatron's process groups
are per process, and a GPU checkpoint is loaded on the CPU path by hiding the GPU from one.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parent
REHEARSAL = os.environ.get("TANDEM_GPU_TIER_REHEARSAL") == "1"


def _why_no_gpu() -> str | None:
    if torch.cuda.is_available():
        return None
    if REHEARSAL:
        return None
    build = torch.version.cuda or "none (a CPU build)"
    return f"no CUDA device (torch {torch.__version__}, CUDA build {build}): the GPU tier needs one"


def pytest_collection_modifyitems(config, items):
    why = _why_no_gpu()
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(GPU_DIR):
            item.add_marker(pytest.mark.gpu)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def case_model(tmp_path_factory) -> Path:
    """megatron_case's Qwen2 (2 layers, hidden 64, vocab 61: padded on the Megatron side)."""
    import megatron_case as mc
    return mc.make_model_dir(tmp_path_factory.mktemp("case-model"))


@pytest.fixture(scope="session")
def bf16_run(case_model, tmp_path_factory):
    """bf16_run(backend) -> the reference bf16 run of that backend, made once per session: 2 steps,
    a checkpoint (`ckpt`) and a Hugging Face export (`hf`) after step 1. Megatron's uses the
    distributed optimizer (the default). Several tests compare against it, so the tier starts
    each configuration's process once."""
    from workers import run_worker

    cache: dict[str, dict] = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            d = tmp_path_factory.mktemp(f"bf16-{backend}")
            rec = run_worker(d / "run.pt", "--backend", backend, "--dtype", "bfloat16", "--dist-opt", 1,
                             "--model", case_model, "--steps", 2, "--save-after", 1, d / "ckpt",
                             "--export-after", 1, d / "hf")
            cache[backend] = {**rec, "ckpt": d / "ckpt", "hf": d / "hf"}
        return cache[backend]

    return get
