"""Shared fixtures: a fresh experiment directory with its keys, and the tiny model."""
from __future__ import annotations

import os
import sys

import pytest

from services.protocol import ExpDir, generate_keys

# Roles and tests share two cores: keep each torch process to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def exp(tmp_path) -> ExpDir:
    e = ExpDir(tmp_path / "exp")
    e.root.mkdir(parents=True)
    generate_keys(e.keys)
    return e


@pytest.fixture
def keys(exp):
    from services.protocol import load_keys
    return load_keys(exp.keys)


@pytest.fixture
def python_bin() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A real Hugging Face directory with a small Qwen2 model and a character tokenizer."""
    tiny = pytest.importorskip("rollout.tiny_model")
    out = tmp_path_factory.mktemp("tiny-model")
    tiny.init_tiny(out, seed=0)
    return out
