"""`tandem run` with the trainer on the GPU, both backends: the trainer is SIGKILLed after a GPU
checkpoint and `--resume` continues from it to the last step.

The tiny model and the local backend as `make train-math` runs them (tests/support/local_run.py's
experiment file: 2 groups of 2 samples a step, a checkpoint every step); generation stays on the
embedded CPU server, so only the trainer touches the GPU — the shape of the first GPU run, whose
Megatron trainer died at step 1 (NCCL all-reduce of CPU tensors) and then at its first checkpoint.
That the trainer really runs on CUDA is read from its process: the CUDA driver library is mapped
once a process has initialised CUDA.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from local_run import finish, leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
TOTAL = 6
KILL_AFTER = 2
# How long the first launch may take to reach step KILL_AFTER (TANDEM_GPU_TIER_STALL_S: a short
# device lease would rather have the logs of a stall than wait it out).
STALL_S = float(os.environ.get("TANDEM_GPU_TIER_STALL_S", 300))


def _cuda_mapped(pid: int) -> bool:
    try:
        return "libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _role_logs(exp: ExpDir, chars: int = 3000) -> str:
    """The end of each role's log: a failure on the GPU names what the trainer itself said."""
    logs = sorted((exp.root / "logs").glob("*.log")) if (exp.root / "logs").exists() else []
    return "".join(f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def _checkpoints(exp: ExpDir) -> list[int]:
    root = exp.root / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) if root.exists() else []


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_tandem_run_on_the_gpu_killed_and_resumed_from_a_gpu_checkpoint(tmp_path, tiny_model_dir, backend, on_gpu):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, f"gpu-{backend}")
    exp = ExpDir(tmp_path / f"gpu-{backend}")
    overrides = [f"trainer.backend={backend}", f"trainer.total_steps={TOTAL}"]
    first = tandem("run", cfg, *overrides, cwd=REPO)
    deadline, trainer_pid, on_cuda = time.monotonic() + STALL_S, None, False
    try:
        while not (len(steps(exp)) >= KILL_AFTER and _checkpoints(exp)):
            if first.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the first launch ended or stalled before step {KILL_AFTER}:\n{finish(first, 10)[-4000:]}"
                            f"{_role_logs(exp)}")
            if trainer_pid is None and exp.service_file("trainer").exists():
                trainer_pid = int(json.loads(exp.service_file("trainer").read_text())["pid"])
            time.sleep(0.2)
        on_cuda = _cuda_mapped(trainer_pid)
        os.kill(trainer_pid, signal.SIGKILL)
        out1 = finish(first, 120)
    except BaseException:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        raise
    assert first.returncode != 0, out1[-3000:]
    assert on_cuda == on_gpu, f"trainer {trainer_pid}: CUDA mapped {on_cuda}, GPU present {on_gpu}"
    saved = _checkpoints(exp)
    n_before = len(steps(exp))

    second = tandem("run", cfg, *overrides, "--resume", cwd=REPO)
    out2 = finish(second, 400)
    assert second.returncode == 0, out2[-4000:] + _role_logs(exp)
    resumed = [r["step"] for r in steps(exp)[n_before:]]
    # The resumed launch continues from the last complete checkpoint, whatever the killed one
    # trained after it, up to the last step.
    assert resumed == list(range(max(saved) + 1, TOTAL + 1)), (saved, n_before, resumed)
    log = (exp.root / "logs" / "trainer-0.log").read_text()
    assert f"step-{max(saved)}" in log or "resumed from" in log, log[-3000:]
    assert leftovers(exp) == []
