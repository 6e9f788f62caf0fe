"""Fixtures shared by both tiers: a fresh experiment directory with its keys, the tiny model, a
smaller model and a trajectory factory for the trainer tests.

The suite has two tiers: tests/unit (no processes, no sockets beyond zmq inproc: enforced by
tests/unit/conftest.py) and tests/integration (real processes, sockets, HTTP, SLURM: marked
`integration` by tests/integration/conftest.py). Helper modules both tiers import live in
tests/support (on sys.path through setup.cfg's `pythonpath`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.services.protocol import ExpDir, Trajectory, generate_keys

# Roles and tests share two cores: keep each torch process to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


UNIT_DIR = Path(__file__).resolve().parent / "unit"


# The longest work units (a module, or a directory one worker runs whole: worker_groups.py; a
# minute or more each on 2 cores) start first, so that with several workers (`make test`) none is
# left running one of them alone at the end. The reward tests last of them: their scan for leftover
# sandbox processes is machine-wide, so they come after the code-task runs of e2e/, three long units
# later. (Left in collection order, the reward directory, two minutes of one worker, started last
# but a few small modules and ended the suite alone: the other worker idle for its last 33 s.)
LONGEST_FIRST = ("tests/integration/test_faults.py", "tests/integration/slurm/", "tests/integration/e2e/",
                 "tests/integration/foundation/test_doc_commands.py", "tests/integration/generation/",
                 "tests/integration/contract/", "tests/integration/reward/")


def pytest_collection_modifyitems(config, items):
    """Unit tests run first (fast feedback), and before any integration fixture exists: a
    session-scoped server or cluster of the integration tier would otherwise still be running
    (its threads, its teardown at the session's end) while the unit tier's guard refuses
    processes and sockets. Then LONGEST_FIRST, then the rest, each in collection order."""
    def key(item):
        if Path(str(item.path)).resolve().is_relative_to(UNIT_DIR):
            return 0
        return 1 + next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), len(LONGEST_FIRST))
    items.sort(key=key)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Several workers (`-n`): tests grouped as tests/support/worker_groups.py says, whatever
    `--dist` asks for."""
    from worker_groups import ModuleAndSharedDirScheduling
    return ModuleAndSharedDirScheduling(config, log)


@pytest.fixture(autouse=True)
def _cpu_affinity_kept():
    """A test must leave the pytest process on the CPUs it found: a local launcher pins itself to
    its services pool until its supervisor closes, and every later test's processes would inherit
    one core (a test that built a LocalBackend and never closed it once did so for the rest of
    the suite). Restored either way; the test that changed it fails, named."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    yield
    after = os.sched_getaffinity(0)
    if after != before:
        os.sched_setaffinity(0, before)
        pytest.fail(f"the test left the pytest process pinned to CPUs {sorted(after)} (it had {sorted(before)}): "
                    "close the LocalSupervisor / LocalBackend it made", pytrace=False)


@pytest.fixture
def exp(tmp_path) -> ExpDir:
    e = ExpDir(tmp_path / "exp")
    e.root.mkdir(parents=True)
    generate_keys(e.keys)
    return e


@pytest.fixture
def keys(exp):
    from tandem.services.protocol import load_keys
    return load_keys(exp.keys)


@pytest.fixture
def python_bin() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A real Hugging Face directory with a small Qwen2 model and a character tokenizer."""
    tiny = pytest.importorskip("tandem.rollout.tiny_model")
    out = tmp_path_factory.mktemp("tiny-model")
    tiny.init_tiny(out, seed=0)
    return out


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    """A real HF directory (the tiny model's code path) shrunk further: 2 layers, hidden 32."""
    from tandem.rollout.tiny_model import init_tiny
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
