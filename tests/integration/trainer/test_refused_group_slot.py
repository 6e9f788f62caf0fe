"""A group the trainer refuses gives its admission slot back (issue 19, defect 1).

Real processes: `tandem controller` and `tandem trainer`; the test plays the rollout worker —
it is admitted three groups, pushes their trajectories (one sample carries a non-finite
behaviour log-prob, as `rollout.temperature: nan` once produced; another group is the first's
prompt sent again, as a worker killed before it saved the first's receipts does) and reports all
accepted. Before the fix the refused group kept its slot for good (the controller counted it
accepted), so capacity shrank with every refusal until admission stopped and the run hung at
step 0; before prompt keys, the prompt sent again would have been trained a second time.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from trainer_feed import send

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import (
    AdmitRequest,
    ExpDir,
    GroupDone,
    StatusRequest,
    SyncRequestClient,
    generate_keys,
    load_keys,
    read_metrics,
    read_service,
)

pytestmark = pytest.mark.timeout(180)


def _start(exp: ExpDir, *role: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", *role, "--exp", str(exp.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_refused_group_releases_its_admission_slot(tmp_path, small_model_dir, traj):
    exp = ExpDir(tmp_path / "exp")
    exp.root.mkdir()
    generate_keys(exp.keys)
    # B = 3, eta = 0: exactly three groups may be admitted before the trainer trains a step.
    save_resolved(load_config(None, ["experiment.name=refused", f"experiment.exp_dir={exp.root}", f"experiment.model={small_model_dir}",
                                     "trainer.groups_per_step=3", "controller.max_staleness=0",
                                     "trainer.total_steps=5"]), exp.root)
    procs = [_start(exp, "controller")]
    try:
        controller = read_service(exp, "controller", timeout_s=60)
        procs.append(_start(exp, "trainer"))
        read_service(exp, "trainer", timeout_s=120)
        client = SyncRequestClient(load_keys(exp.keys), controller["address"], timeout_s=30)
        reply = client.request(AdmitRequest("w", max_groups=5))
        (good, v0), (bad, v1), (again, v2) = [(t.group_id, t.admit_version) for t in reply.tickets]
        assert client.request(AdmitRequest("w", max_groups=5)).tickets == []    # the bound holds
        samples = [traj(good, k, group_size=2, admit_version=v0) for k in range(2)]
        poisoned = traj(bad, 0, group_size=2, admit_version=v1)
        poisoned.output_logprobs[0] = float("nan")
        samples += [poisoned, traj(bad, 1, group_size=2, admit_version=v1)]
        samples += [traj(again, k, group_size=2, admit_version=v2) for k in range(2)]
        for t in samples:
            t.prompt_key = "0:7"   # one prompt: good's, sent again as `again`
        send(exp, samples)
        for gid in (good, bad, again):
            client.request(GroupDone("w", gid, "accepted"))

        deadline = time.monotonic() + 60
        while (state := client.request(StatusRequest()).state)["dropped"] < 2:
            assert time.monotonic() < deadline, f"the refused groups never gave their slots back: {state}"
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs]
            time.sleep(0.2)
        assert (state["accepted"], state["dropped"]) == (1, 2)
        # Their slots are free again: two more groups may start (the good one still holds its own).
        assert len(client.request(AdmitRequest("w", max_groups=5)).tickets) == 2
        client.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    # No step was trained: the trainer's exit record alone names the refused groups as dropped,
    # beside the good one it still holds (`tandem audit` would otherwise call them lost).
    (exit_record,) = read_metrics(exp, "trainer", "exit")
    assert (sorted(exit_record["dropped_ids"]), exit_record["held_ids"]) == (sorted([bad, again]), [good])
