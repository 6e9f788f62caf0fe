"""The trainer takes only what its sender may send (issue 68): a real trainer process, fed over
ZeroMQ by clients each holding one worker's key (services/protocol/keys.py), its controller the
trainer tests' stand-in (fake_controller.py).

With every role sharing one key, a worker could train a group the controller never admitted,
or squat the next group ids with bad samples until the trainer refused the real groups (the run
stalled for good); one trajectory with token id 10^9 entered the trainer's log and killed it at
every resume. Now the trainer refuses, alone, a sample whose ticket was not signed for its
sender, and a group whose tokens the model has no embedding for; neither reaches its log, so a
resume is clean, and the real groups train.
"""
from __future__ import annotations

import asyncio

from test_trainer_loop import FakeController, finish, make_exp, start_trainer

from tandem.services.protocol import (
    TrajectorySource,
    generate_keys,
    load_keys,
    read_metrics,
    read_service,
    ticket_mac,
)
from tandem.trainer.wal import replay


def _trajectory(traj, gid, k, mac="", **kw):
    t = traj(gid, k, group_size=2, admit_version=0, reward=5.0 if k == 0 else -5.0, seed=k, out_len=4, prompt_len=3,
             **kw)
    t.ticket_mac, t.prompt_key = mac, f"0:{gid}"
    return t


def test_the_trainer_trains_only_groups_admitted_to_their_sender(tmp_path, small_model_dir, traj, python_bin):
    exp = make_exp(tmp_path, "run", small_model_dir, **{"trainer.total_steps": 1, "trainer.groups_per_step": 2,
                                                        "trainer.checkpoint_every": 1})
    generate_keys(exp.keys, ["rollout-0", "rollout-1"])
    ctl = FakeController(exp, python_bin)
    try:
        proc = start_trainer(exp)
        mac = {g: ticket_mac(exp.keys, g, 0, "rollout-0") for g in ("g1", "g2", "g3")}
        forged = [
            # rollout-1 squats group g1 (admitted to rollout-0) with a bad sample, before the real one
            (_trajectory(traj, "g1", 0, mac["g1"]), "rollout-1"),
            # a group the controller never admitted
            (_trajectory(traj, "made-up", 0, "0" * 32), "rollout-1"),
        ]
        bad_tokens = [_trajectory(traj, "g3", k, mac["g3"]) for k in range(2)]
        bad_tokens[1].output_ids[-1] = 10**9     # no embedding: the whole group g3 is refused
        for t, who in forged:
            _send_as(exp, who, [t])
        _send_as(exp, "rollout-0", bad_tokens)   # before the step's groups: refused while the trainer collects
        _send_as(exp, "rollout-0", [_trajectory(traj, g, k, mac[g]) for g in ("g1", "g2") for k in range(2)])
        finish(proc, exp)
    finally:
        ctl.close()
    (step,) = read_metrics(exp, "trainer", "step")
    assert step["group_ids"] == ["g1", "g2"]        # the real groups trained, the squat did not stop them
    thrown = read_metrics(exp, "trainer", "thrown_away")
    samples = [s for r in thrown for s in r.get("samples", [])]
    assert {(s["group_id"], s["sender"]) for s in samples} == {("g1", "rollout-1"), ("made-up", "rollout-1")}
    assert all("was not admitted to rollout-1" in s["reason"] for s in samples)
    assert any(r.get("group_ids") == ["g3"] and "outside the vocabulary" in r["reason"] for r in thrown)
    # Nothing refused is in the log a resume replays.
    logged = [(t.group_id, t.sample_idx) for p in sorted(exp.checkpoints.glob("trajectories-*.wal")) for t in replay(p)]
    assert ("made-up", 0) not in logged and not any(g == "g3" for g, _ in logged)


def _send_as(exp, identity: str, trajectories) -> None:
    """Push trajectories to the trainer as `identity` (its own key), as a rollout worker does."""
    info = read_service(exp, "trainer", timeout_s=60)

    async def go():
        src = TrajectorySource(load_keys(exp.keys, identity), info["trajectory_address"])
        done = asyncio.Event()
        await src.send_group(trajectories, on_receipted=done.set)
        await asyncio.wait_for(done.wait(), 60)   # receipted: refused ones too, the trainer decided
        src.close()
    asyncio.run(go())
