"""The trainer as a real process: `tandem trainer --exp DIR`, fed over ZeroMQ, killed, resumed.

The controller is a stand-in (fake_controller.py, its own process): a real `RequestServer`
(CURVE, ZeroMQ) that answers the weight messages with `weights_ack` and can hold an ack back, which
pins down where the trainer is when the test kills it. It announces itself in `<exp>/services/controller.json` as
the controller does. Trajectories come from a real `TrajectorySource`.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from process_starts import start, wait_or_kill
from rank_processes import rank_errors, reap, start_ranks
from safetensors.torch import load_file
from trainer_feed import send

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir, generate_keys, read_metrics, read_service
from tandem.trainer.wal import replay, wal_path, wal_seqs


class FakeController:
    """Runs fake_controller.py in its own process; `received` lists the announced versions."""

    def __init__(self, exp: ExpDir, python_bin: str, hold: set[int] = frozenset()):
        self.exp = exp
        self.state = exp.root / "fake-controller"
        exp.service_file("controller").unlink(missing_ok=True)
        self.proc = subprocess.Popen([python_bin, str(Path(__file__).with_name("fake_controller.py")),
                                      str(exp.root), ",".join(map(str, sorted(hold)))])
        read_service(exp, "controller", timeout_s=30)

    @property
    def received(self) -> list[int]:
        f = self.state / "received"
        return [int(x) for x in f.read_text().split()] if f.exists() else []

    @property
    def resumed(self) -> list[tuple[int, int]]:
        f = self.state / "resumed"
        return [tuple(map(int, line.split())) for line in f.read_text().splitlines()] if f.exists() else []

    def set_rejected(self, n: int):
        (self.state / "rejected").write_text(str(n))

    def release(self, version: int):
        (self.state / f"release-{version}").touch()

    def wait_received(self, version: int, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while version not in self.received:
            assert time.monotonic() < deadline, f"no weight message for v{version} (got {self.received})"
            assert self.proc.poll() is None, "the fake controller died"
            time.sleep(0.05)

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


def make_exp(tmp_path, name, model_dir, **overrides) -> ExpDir:
    exp = ExpDir(tmp_path / name)
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    ov = {"experiment.name": name, "experiment.model": str(model_dir), "experiment.exp_dir": str(exp.root),
          "trainer.groups_per_step": 2, "trainer.total_steps": 2, "trainer.checkpoint_every": 1,
          "trainer.optim.lr": 0.01, "trainer.max_tokens_per_mb": 40, "trainer.ppo_n_minibatches": 2,
          # the longest sample the budget must hold (the config check refuses a smaller one)
          "rollout.max_prompt_tokens": 8, "rollout.max_new_tokens": 32,
          "controller.max_staleness": 4, **overrides}
    save_resolved(load_config(None, [f"{k}={v}" for k, v in ov.items()]), exp.root)
    return exp


def start_trainer(exp: ExpDir, *extra):
    """`tandem trainer` (process_starts.start), its output appended to <exp>/trainer.console."""
    return start(["-m", "tandem.launcher.cli", "trainer", "--exp", str(exp.root), *extra], exp.root / "trainer.console")


def groups(traj, specs):
    """specs: [(group_id, admit_version)], two samples each, deterministic content."""
    out = []
    for n, (gid, v) in enumerate(specs):
        for k in range(2):
            t = traj(gid, k, group_size=2, admit_version=v, reward=5.0 if k == n % 2 else -5.0,
                     seed=100 * n + k, out_len=4 + (n + k) % 5, prompt_len=3 + n % 3)
            # the reward's flags, as the workflow copies them from the verdicts (issue 22)
            t.timings.update(hedged=float(gid == "b" and k == 0), limit_hit=float(gid == "c"))
            out.append(t)
    return out


def finish(proc, exp: ExpDir, timeout=120) -> int:
    if not wait_or_kill(proc, timeout):
        pytest.fail(f"trainer did not finish:\n{(exp.root / 'trainer.console').read_text()[-3000:]}")
    assert proc.returncode == 0, (exp.root / "trainer.console").read_text()[-3000:]
    return proc.returncode


SPECS = [("a", 0), ("b", 0), ("c", 0), ("d", 1)]


def step_dirs(exp: ExpDir) -> list[str]:
    return sorted(p.name for p in exp.checkpoints.iterdir() if p.name.startswith("step-"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, small_model_dir, traj):
    """An uninterrupted single-rank run of two steps: step 1 trains a, b; step 2 trains c, d."""
    python_bin = sys.executable
    ref = make_exp(tmp_path_factory.mktemp("ref"), "ref", small_model_dir)
    ctl = FakeController(ref, python_bin)
    ctl.set_rejected(3)   # groups the workflows rejected (dynamic sampling), as the ledger counts them
    try:
        proc = start_trainer(ref)
        send(ref, groups(traj, SPECS))
        finish(proc, ref)
    finally:
        ctl.close()
    assert ctl.received == [1, 2]
    return ref


def test_reference_run_publishes_logs_and_checkpoints(reference_run):
    ref = reference_run
    recs = read_metrics(ref, "trainer", "step")
    assert [r["step"] for r in recs] == [1, 2]
    # per step, the answers the reward refused: a hedge in b (step 1), limits in c (step 2)
    assert [(r["reward_hedged"], r["reward_limits_hit"]) for r in recs] == [(1, 0), (0, 2)]
    assert recs[0]["group_ids"] == ["a", "b"] and recs[1]["group_ids"] == ["c", "d"]
    assert [r["dynamic_filtered_groups"] for r in recs] == [3, 0]   # per step, from the ledger's total
    # step 2 trains c (admitted at v0) and d (v1) at version 1
    assert recs[1]["staleness_hist"] == {"0": 1, "1": 1}
    assert recs[1]["staleness_hist_total"] == {"0": 3, "1": 1}
    assert recs[0]["ack_ok"] is True and "export_s" in recs[0] and "ack_update_s" in recs[0]
    assert step_dirs(ref) == ["step-1", "step-2"]
    assert read_service(ref, "trainer")["trajectory_address"].startswith("tcp://")


def test_sigterm_sigkill_and_resume_give_the_same_steps_as_an_uninterrupted_run(tmp_path, small_model_dir,
                                                                                   traj, python_bin,
                                                                                   reference_run):
    ref = reference_run
    data = groups(traj, SPECS)
    run = make_exp(tmp_path, "run", small_model_dir)
    ctl = FakeController(run, python_bin, hold={2})
    ctl.set_rejected(3)
    try:
        # 1. Everything but the second sample of d; step 1 runs, then the trainer waits for d.
        proc = start_trainer(run)
        send(run, data[:7])
        ctl.wait_received(1)
        deadline = time.monotonic() + 60
        while not (run.checkpoints / "step-1").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        # 2. SIGTERM: a clean exit with a checkpoint holding c (complete) and half of d.
        pid1 = read_service(run, "trainer")["pid"]
        proc.send_signal(signal.SIGTERM)
        finish(proc, run, timeout=60)
        assert step_dirs(run) == ["step-1"] and not (run.weights / "v2").exists()
        # 3. Resume, send the missing sample: step 2 runs; while v2 waits for its ack, a group
        #    admitted at v2 (past the step-1 checkpoint) is logged; then SIGKILL.
        proc = start_trainer(run, "--resume")
        send(run, data[7:], old_pid=pid1)
        ctl.wait_received(2)
        send(run, groups(traj, [("future", 2)]))
        deadline = time.monotonic() + 60
        while "future" not in {t.group_id for seq in wal_seqs(run.checkpoints)
                               for t in replay(wal_path(run.checkpoints, seq))}:
            assert time.monotonic() < deadline, "the trainer never logged the group admitted at v2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert step_dirs(run) == ["step-1"] and (run.weights / "v2").exists()
        # 4. Resume again: nothing is sent; step 2 is redone from the checkpoint's buffer.
        ctl.release(2)
        proc = start_trainer(run, "--resume")
        finish(proc, run)
    finally:
        ctl.close()
    # Each resume republishes its checkpoint's version (v1) before training on: servers of an
    # abandoned future (here the unacknowledged v2) come back to the policy training continues from.
    assert ctl.received == [1, 1, 2, 1, 2]
    # each resume told the controller its version and the groups it holds: after SIGTERM a, b
    # (trained) + c (complete; d was half); after SIGKILL also d (its second half from the log)
    assert ctl.resumed == [(1, 3), (1, 4)]
    # the group admitted at v2 by the killed launch: discarded by the resume from step 1, and said
    # to be, so the audit finds where it went (dropped, not lost)
    assert [r["dropped_ids"] for r in read_metrics(run, "trainer", "discarded_future")] == [["future"]]
    recs = read_metrics(run, "trainer", "step")
    assert [r["step"] for r in recs] == [1, 2]              # numbering continued; step 2 logged once
    assert [r["dynamic_filtered_groups"] for r in recs] == [3, 0]   # the count seen survived too
    assert recs[1]["staleness_hist_total"] == {"0": 3, "1": 1}   # accounting survived two restarts
    assert step_dirs(run) == ["step-1", "step-2"]
    for v in (1, 2):
        a = load_file(ref.weights / f"v{v}" / "model.safetensors")
        b = load_file(run.weights / f"v{v}" / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (v, k)
    assert not torch.equal(a["model.norm.weight"],
                           load_file(ref.weights / "v1" / "model.safetensors")["model.norm.weight"])


def test_two_data_parallel_ranks_match_one_rank(tmp_path, small_model_dir, traj, python_bin, reference_run):
    """Two trainer processes over gloo (env:// rendezvous, as the launcher starts them)."""
    exp = make_exp(tmp_path, "dp", small_model_dir, **{"trainer.total_steps": 1})
    ctl = FakeController(exp, python_bin)
    procs = []
    try:
        procs, logs = start_ranks(["-m", "tandem.launcher.cli", "trainer", "--exp", str(exp.root)], tmp_path, "trainer")
        send(exp, groups(traj, SPECS[:2]))
        errors = rank_errors(procs, logs, timeout_s=120)
    finally:
        reap(procs)
        ctl.close()
    assert not errors, "\n----\n".join(errors)
    (dp,) = read_metrics(exp, "trainer", "step")
    one = read_metrics(reference_run, "trainer", "step")[0]
    for key in ("loss", "grad_norm", "valid_tokens", "entropy", "clip_fraction"):
        assert dp[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    a = load_file(reference_run.weights / "v1" / "model.safetensors")
    b = load_file(exp.weights / "v1" / "model.safetensors")
    for k in a:   # Adam turns float noise in ~zero gradients into steps of up to ~lr/100
        assert torch.allclose(a[k], b[k], atol=1e-3), k
    # both ranks applied the same all-reduced update
    r0 = torch.load(exp.checkpoints / "step-1" / "rank-0.pt", weights_only=False)["backend"]["model"]
    r1 = torch.load(exp.checkpoints / "step-1" / "rank-1.pt", weights_only=False)["backend"]["model"]
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k


def test_broadcast_weight_sync_delivers_the_trained_tensors(tmp_path, small_model_dir, traj, python_bin):
    """weight_sync: broadcast end to end: the stand-in controller joins the gloo group on
    weights_broadcast, receives every tensor, then acks."""
    exp = make_exp(tmp_path, "bcast", small_model_dir, **{"trainer.total_steps": 1,
                                                           "trainer.weight_sync": "broadcast"})
    ctl = FakeController(exp, python_bin)
    try:
        proc = start_trainer(exp)
        send(exp, groups(traj, SPECS[:2]))
        finish(proc, exp)
    finally:
        ctl.close()
    (rec,) = read_metrics(exp, "trainer", "step")
    assert rec["transfer_ok"] is True and rec["ack_ok"] is True and rec["bytes"] > 0
    got = torch.load(exp.root / "fake-controller" / "broadcast-v1.pt")
    model = torch.load(exp.checkpoints / "step-1" / "rank-0.pt", weights_only=False)["backend"]["model"]
    assert set(got) <= set(model) and "model.embed_tokens.weight" in got
    for name, t in got.items():
        assert torch.equal(t, model[name]), name
    # Nothing went to disk during the run; the final policy did, after it (tandem export reads it).
    assert sorted(p.name for p in exp.weights.iterdir()) == ["v1"]
    final = load_file(exp.weights / "v1" / "model.safetensors")
    for name, t in got.items():
        assert torch.equal(final[name], t), name
