"""The training loop on the Megatron backend checkpoints through dist checkpointing and resumes
into another parallel layout: version, optimizer state and staleness counters survive.

Real processes throughout: `tandem trainer --exp DIR` (megatron-core 0.16.1 on CPU, gloo), fed
over ZeroMQ by a real `TrajectorySource`, with the trainer tests' stand-in controller
(tests/integration/trainer/fake_controller.py, its own process) acking weights and recording resumes.

1. Reference: one rank (TP=1) trains two steps, checkpointing after each (`step-<N>/dist/` is a
   Megatron dist checkpoint; the rank files hold RNG states only).
2. Resume: a new experiment gets the reference's `step-1` checkpoint and is resumed by a
   two-rank job at TP=2, so the checkpoint is resharded on load. It must announce version 1
   holding all four groups, train step 2 from the checkpoint's buffer (nothing is sent), keep
   the staleness histogram of the whole run, and land on the reference's step 2: the same Adam
   moments, update count and weights (up to TP=2's summation order), which only happens when
   the optimizer state came through the checkpoint.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import megatron_case as mc
import numpy as np
import pytest
import torch
from rank_processes import reap, start_ranks, tails
from safetensors.torch import load_file

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import (
    ExpDir,
    Trajectory,
    TrajectorySource,
    generate_keys,
    load_keys,
    read_metrics,
    read_service,
)

pytestmark = pytest.mark.timeout(300)
FAKE_CONTROLLER = Path(__file__).resolve().parents[1] / "trainer" / "fake_controller.py"
# (group id, admit version): step 1 trains a, b; step 2 trains c (staleness 1) and d (0).
GROUPS = [("a", 0), ("b", 0), ("c", 0), ("d", 1)]


def _trajectories() -> list[Trajectory]:
    out = []
    for n, (gid, v) in enumerate(GROUPS):
        for k in range(2):
            rng = np.random.default_rng(100 * n + k)
            m = 4 + (n + k) % 5
            out.append(Trajectory(
                group_id=gid, sample_idx=k, group_size=2,
                prompt_ids=rng.integers(1, mc.VOCAB, 3 + n % 3).astype(np.int32),
                output_ids=rng.integers(1, mc.VOCAB, m).astype(np.int32),
                output_logprobs=(-rng.random(m) * 3).astype(np.float32),
                output_versions=np.full(m, v, np.int32), admit_version=v,
                reward=5.0 if k == n % 2 else -5.0, finish_reason="stop", task="math",
                timings={"gen_s": 0.1}))
    return out


def _make_exp(root: Path, model_dir: Path, tp: int) -> ExpDir:
    exp = ExpDir(root)
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    ov = {"experiment.name": root.name, "experiment.model": str(model_dir),
          "experiment.exp_dir": str(root), "trainer.backend": "megatron",
          "trainer.tensor_parallel": tp, "trainer.groups_per_step": 2, "trainer.total_steps": 2,
          "trainer.checkpoint_every": 1, "trainer.keep_checkpoints": 2, "trainer.optim.lr": 0.01,
          "trainer.max_tokens_per_mb": 40, "trainer.ppo_n_minibatches": 2,
          "rollout.max_prompt_tokens": 8, "rollout.max_new_tokens": 32,
          "controller.max_staleness": 4}
    save_resolved(load_config(None, [f"{k}={v}" for k, v in ov.items()]), exp.root)
    return exp


class _Controller:
    def __init__(self, exp: ExpDir):
        self.state = exp.root / "fake-controller"
        self.proc = subprocess.Popen([sys.executable, str(FAKE_CONTROLLER), str(exp.root), ""])
        read_service(exp, "controller", timeout_s=30)

    def lines(self, name: str) -> list[str]:
        f = self.state / name
        return f.read_text().split("\n")[:-1] if f.exists() else []

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


def _run_trainer(exp: ExpDir, world: int, *extra: str, send: list[Trajectory] = ()) -> None:
    """Start `world` trainer ranks (env:// rendezvous as the launcher does), feed them, wait."""
    procs, logs = start_ranks(["-m", "tandem.launcher.cli", "trainer", "--exp", str(exp.root), *extra], exp.root, "trainer",
                              world)
    try:
        if send:
            deadline = time.monotonic() + 120
            while not exp.service_file("trainer").exists() and time.monotonic() < deadline \
                    and all(p.poll() is None for p in procs):
                time.sleep(0.1)
            if exp.service_file("trainer").exists():  # else the logs below say why
                _send(exp, read_service(exp, "trainer")["trajectory_address"], send)
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        reap(procs)
    assert all(p.returncode == 0 for p in procs), tails(logs)


def _send(exp: ExpDir, address: str, trajectories: list[Trajectory]) -> None:
    async def go():
        src = TrajectorySource(load_keys(exp.keys), address)
        for t in trajectories:
            await src.send(t)
        src.close()
    asyncio.run(go())


def _assert_same_up_to_padding(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal to 1e-4 of the tensor's scale; vocabulary rows padded differently per TP size
    (128 rows at TP=1, 256 at TP=2) must be zero beyond the shorter one."""
    n = min(got.shape[0], want.shape[0])
    assert got.shape[1:] == want.shape[1:], name
    assert not got[n:].any() and not want[n:].any(), name
    scale = float(want.abs().max())
    assert scale > 0, name
    assert float((got[:n] - want[:n]).abs().max()) <= 1e-4 * scale, name


def _dcp(path: Path) -> dict:
    """A torch_dist (DCP) checkpoint as one flat dict of global tensors, read without a job."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mloop")
    model_dir = mc.make_model_dir(tmp / "model")
    ref = _make_exp(tmp / "ref", model_dir, tp=1)
    ctl = _Controller(ref)
    try:
        _run_trainer(ref, 1, send=_trajectories())
    finally:
        ctl.close()
    assert ctl.lines("received") == ["1", "2"]
    res = _make_exp(tmp / "resumed", model_dir, tp=2)
    res.checkpoints.mkdir(parents=True)
    shutil.copytree(ref.checkpoints / "step-1", res.checkpoints / "step-1")
    ctl = _Controller(res)
    try:
        _run_trainer(res, 2, "--resume")
    finally:
        ctl.close()
    return {"ref": ref, "res": res, "res_received": ctl.lines("received"),
            "res_resumed": ctl.lines("resumed")}


def test_loop_checkpoints_are_dist_checkpoints(runs):
    ref = runs["ref"]
    for step in (1, 2):
        d = ref.checkpoints / f"step-{step}"
        assert (d / "dist" / "metadata.json").exists() and (d / "dist" / "common.pt").exists()
        rank_state = torch.load(d / "rank-0.pt", weights_only=False)
        assert set(rank_state) == {"rng"}  # the model and optimizer are in dist/ only
    assert [r["step"] for r in read_metrics(ref, "trainer", "step")] == [1, 2]


def test_resume_at_another_layout_keeps_version_and_staleness(runs):
    ref, res = runs["ref"], runs["res"]
    # version 1, holding a and b (trained) plus c and d (in the checkpoint's buffer)
    assert runs["res_resumed"] == ["1 4"]
    # the resumed job republishes its checkpoint's version (exported from the resharded model), then v2
    assert runs["res_received"] == ["1", "2"]
    (rec,) = read_metrics(res, "trainer", "step")
    ref2 = read_metrics(ref, "trainer", "step")[1]
    assert rec["step"] == 2 and rec["version_trained"] == 1
    assert rec["staleness_hist"] == ref2["staleness_hist"] == {"0": 1, "1": 1}
    assert rec["staleness_hist_total"] == ref2["staleness_hist_total"] == {"0": 3, "1": 1}
    assert rec["token_staleness_hist_total"] == ref2["token_staleness_hist_total"]
    assert rec["loss"] == pytest.approx(ref2["loss"], rel=1e-4, abs=1e-6)
    assert rec["grad_norm"] == pytest.approx(ref2["grad_norm"], rel=1e-4)
    assert (rec["train_world_size"], ref2["train_world_size"]) == (2, 1)


def test_resume_at_another_layout_keeps_the_optimizer_state(runs):
    ref, res = runs["ref"], runs["res"]
    a = _dcp(ref.checkpoints / "step-2" / "dist")
    b = _dcp(res.checkpoints / "step-2" / "dist")
    assert a.keys() == b.keys()
    moments = [k for k in a if k.startswith("optimizer.state.exp_avg")]
    assert len(moments) == 2 * sum(k.endswith("weight") or k.endswith("bias") for k in a
                                   if not k.startswith("optimizer."))
    for k in moments:
        _assert_same_up_to_padding(b[k], a[k], k)
    common = [torch.load(e.checkpoints / "step-2" / "dist" / "common.pt", weights_only=False)
              for e in (ref, res)]
    # two steps of ppo_n_minibatches=2 updates: the warm-up position and Adam's bias correction
    assert common[0]["updates"] == common[1]["updates"] == 4
    assert common[0]["adam_step"] == common[1]["adam_step"] == 4
    wa = load_file(ref.weights / "v2" / "model.safetensors")
    wb = load_file(res.weights / "v2" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:  # Adam turns float noise in ~zero gradients into steps of up to ~lr/100
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-3, msg=k)
