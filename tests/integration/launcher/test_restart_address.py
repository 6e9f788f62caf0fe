"""A restarted controller or reward service comes back at the address its clients hold (issue 19).

Real roles under the local backend: the controller and the reward service are started as
`tandem run` starts them, killed with SIGKILL, restarted by the backend, and must announce the
same `tcp://host:port` — the supervisor keeps the old announcement (the new process reads its
port from it) and takes the new write as the sign of readiness. A client opened before the crash
then gets an answer from the new process without re-reading anything.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from model_dirs import checked_model_dir

from tandem.launcher.backends.local import LocalBackend
from tandem.launcher.roles import experiment_roles
from tandem.launcher.run import prepare
from tandem.services.protocol import StatusRequest, SyncRequestClient, load_keys

pytestmark = pytest.mark.timeout(180)


def _ended(backend, name, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = [e for e in backend.ended() if e.role.name == name]
        if ended:
            return ended[0]
        time.sleep(0.2)
    raise AssertionError(f"{name}'s exit was never noticed")


def test_controller_and_reward_service_restart_on_their_previous_port(tmp_path):
    cfg_file = tmp_path / "exp.yaml"
    model = checked_model_dir(tmp_path / "model")
    cfg_file.write_text(f"experiment: {{name: restart, exp_dir: {tmp_path / 'run'}, model: {model}}}\n"
                        "reward: {num_workers: 1}\n")
    cfg, exp = prepare(str(cfg_file), [], False)
    roles = {r.name: r for r in experiment_roles(cfg, exp, False, pick_port=lambda: 0)}
    backend = LocalBackend(cfg, exp)
    try:
        for name, service in (("controller-0", "controller"), ("reward-0", "reward")):
            backend.start([roles[name]])
            before = json.loads(exp.service_file(service).read_text())
            client = SyncRequestClient(load_keys(exp.keys), before["address"], timeout_s=60)
            assert client.request(StatusRequest()).state["role"] == service
            os.kill(before["pid"], signal.SIGKILL)
            ended = _ended(backend, name)
            assert ended.restarted and not ended.ok and "status -9" in ended.why
            after = json.loads(exp.service_file(service).read_text())
            assert after["pid"] != before["pid"]
            assert after["address"] == before["address"], (before, after)
            # The client made before the crash reaches the new process at the same address.
            assert client.request(StatusRequest()).state["role"] == service
            client.close()
    finally:
        backend.close("test")
