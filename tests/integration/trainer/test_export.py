"""`tandem export` on short real runs of both backends: the output loads in transformers, generates,
and holds the run's tensors.

Each run is a real trainer (`tandem trainer --exp DIR`: the torch backend in one process, the
Megatron backend at TP 2 in two, megatron-core on CPU, gloo) fed over ZeroMQ, with the trainer tests'
stand-in controller acking the weights; two steps, a checkpoint after each, both versions
published. Then, for each run, `tandem export` as a user runs it:

- `--from checkpoint` converts `checkpoints/step-N/` (the torch backend's rank-0 state; the
  Megatron backend's `dist/`, resharded from TP 2 to one CPU process) and must equal, tensor for
  tensor, the `weights/vN` the live trainer published for the same version;
- the default (no `--version`) is the run's final version, copied from `weights/v2`;
- both load with `AutoModelForCausalLM.from_pretrained` and generate the same greedy tokens.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from local_run import export
from rank_processes import reap, start_ranks, tails
from safetensors.torch import load_file
from trainer_feed import send

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir, Trajectory, generate_keys, read_service

pytestmark = pytest.mark.timeout(600)
FAKE_CONTROLLER = Path(__file__).with_name("fake_controller.py")
# (group id, admit version): two steps of two groups.
SPECS = [("a", 0), ("b", 0), ("c", 0), ("d", 1)]


def _trajectories() -> list[Trajectory]:
    out = []
    for n, (gid, v) in enumerate(SPECS):
        for k in range(2):
            rng = np.random.default_rng(100 * n + k)
            m = 4 + (n + k) % 5
            out.append(Trajectory(
                group_id=gid, sample_idx=k, group_size=2, prompt_ids=rng.integers(1, 60, 3 + n % 3).astype(np.int32),
                output_ids=rng.integers(1, 60, m).astype(np.int32), output_logprobs=(-rng.random(m) * 3).astype(np.float32),
                output_versions=np.full(m, v, np.int32), admit_version=v, reward=5.0 if k == n % 2 else -5.0,
                finish_reason="stop", task="math", timings={"gen_s": 0.1}))
    return out


def _exp(root: Path, model_dir: Path, backend: str) -> ExpDir:
    exp = ExpDir(root)
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    ov = {"experiment.name": root.name, "experiment.model": str(model_dir), "experiment.exp_dir": str(root),
          "trainer.backend": backend, "trainer.tensor_parallel": 2 if backend == "megatron" else 1,
          "trainer.groups_per_step": 2, "trainer.total_steps": 2, "trainer.checkpoint_every": 1,
          "trainer.keep_checkpoints": 2, "trainer.keep_weights": 2, "trainer.optim.lr": 0.01,
          "rollout.max_prompt_tokens": 8, "rollout.max_new_tokens": 32, "trainer.max_tokens_per_mb": 40,
          "controller.max_staleness": 4}
    save_resolved(load_config(None, [f"{k}={v}" for k, v in ov.items()]), exp.root)
    return exp


def _train(exp: ExpDir, world: int, trajectories) -> None:
    """`world` trainer ranks (env:// rendezvous, as the launcher starts them) until they finish."""
    ctl = subprocess.Popen([sys.executable, str(FAKE_CONTROLLER), str(exp.root), ""])
    procs, logs = [], []
    try:
        read_service(exp, "controller", timeout_s=30)
        procs, logs = start_ranks(["-m", "tandem.launcher.cli", "trainer", "--exp", str(exp.root)], exp.root, "trainer", world)
        send(exp, trajectories)
        deadline = time.monotonic() + 400
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        reap(procs)
        ctl.terminate()
        ctl.wait(10)
    assert all(p.returncode == 0 for p in procs), tails(logs)


@pytest.fixture(scope="module", params=["torch", "megatron"])
def run(request, tmp_path_factory, small_model_dir):
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"export-{backend}")
    exp = _exp(tmp / "run", small_model_dir, backend)
    _train(exp, 2 if backend == "megatron" else 1, _trajectories())
    assert sorted(p.name for p in exp.weights.iterdir() if p.name.startswith("v")) == ["v1", "v2"]
    return backend, exp, tmp


def _generate(path: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([[5, 17, 3, 9]]), max_new_tokens=6, do_sample=False)
    return out[0, 4:].tolist()


def test_a_checkpoint_exports_the_tensors_the_run_published(run, small_model_dir):
    backend, exp, tmp = run
    out = tmp / "from-checkpoint-v1"
    done = export(exp, out, "--version", "v1", "--from", "checkpoint")
    assert (done["version"], done["from"], done["final"]) == (1, "checkpoints/step-1", False)
    assert done["dtype"] == "float32"   # the CPU runs train float32; a Megatron export is float32 anyway
    got, published = load_file(out / "model.safetensors"), load_file(exp.weights / "v1" / "model.safetensors")
    base = load_file(small_model_dir / "model.safetensors")
    assert got.keys() == published.keys()
    for k in got:
        torch.testing.assert_close(got[k], published[k], rtol=0, atol=0, msg=k)
    # and it is the trained policy, not the base model it started from
    assert any(not torch.equal(got[k], base[k]) for k in got if k in base)
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert len(_generate(out)) == 6


def test_the_default_is_the_final_version_and_it_generates(run):
    backend, exp, tmp = run
    out = tmp / "final"
    done = export(exp, out)
    assert (done["version"], done["from"], done["final"]) == (2, "weights/v2", True)
    for k, t in load_file(exp.weights / "v2" / "model.safetensors").items():
        assert torch.equal(load_file(out / "model.safetensors")[k], t), k
    converted = tmp / "final-from-checkpoint"
    assert export(exp, converted, "--from", "checkpoint")["from"] == "checkpoints/step-2"
    assert _generate(out) == _generate(converted)


def test_export_refusals_name_what_exists(run):
    """... before torch is imported (-X importtime lists every import): a typo is answered at once."""
    backend, exp, tmp = run
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tandem.launcher.cli", "export", "--exp", str(exp.root),
                           "--version", "7", str(tmp / "nope")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no version 7" in proc.stderr
    assert "published weights: v1, v2; checkpoints: v1, v2" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.rpartition("|")[2].strip() == "torch"]
    assert not (tmp / "nope").exists()
    (tmp / "taken").mkdir()
    (tmp / "taken" / "x").write_text("")
    proc = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "export", "--exp", str(exp.root), str(tmp / "taken")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not an empty directory" in proc.stderr
