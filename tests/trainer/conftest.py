"""Fixtures of the trainer tests: a very small model and a trajectory factory."""
from __future__ import annotations

import numpy as np
import pytest

from services.protocol import Trajectory


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    """A real HF directory (the tiny model's code path) shrunk further: 2 layers, hidden 32."""
    from rollout.tiny_model import init_tiny
    out = tmp_path_factory.mktemp("small-model")
    init_tiny(out, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, max_position=256, seed=0)
    return out


def make_trajectory(group_id: str, sample_idx: int, group_size: int = 2, admit_version: int = 0,
                    prompt_len: int = 5, out_len: int = 4, reward: float = 1.0, seed: int = 0,
                    vocab: int = 200, versions: list[int] | None = None,
                    logprobs: np.ndarray | None = None, prompt=None, output=None) -> Trajectory:
    rng = np.random.default_rng(seed)
    prompt = np.asarray(prompt if prompt is not None else rng.integers(7, vocab, prompt_len), np.int32)
    output = np.asarray(output if output is not None else rng.integers(7, vocab, out_len), np.int32)
    n = len(output)
    return Trajectory(
        group_id=group_id, sample_idx=sample_idx, group_size=group_size, prompt_ids=prompt,
        output_ids=output,
        output_logprobs=np.asarray(logprobs if logprobs is not None else -rng.random(n) * 3, np.float32),
        output_versions=np.asarray(versions if versions is not None else [admit_version] * n, np.int32),
        admit_version=admit_version, reward=reward, finish_reason="stop", task="math",
        timings={"gen_s": 0.1})


@pytest.fixture(scope="session")
def traj():
    """make_trajectory(group_id, sample_idx, ...) -> Trajectory."""
    return make_trajectory
