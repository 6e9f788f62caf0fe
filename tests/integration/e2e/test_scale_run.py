"""`tandem scale` on a running local experiment: a generation server joins (caught up to the
current weights before it takes requests), the original one leaves (its requests go on on the
newcomer), the run trains on, and the audit accounts for every group.

Everything is real: `tandem run` (the launcher, every role a process), `tandem scale` as a user
types it in another shell, the controller's catch-up from disk and retirement, the embedded
servers. This machine has 2 CPUs, both in the run's pools (generation 0, training 1): the first
add, without --cpus, is refused for that reason; the second names CPU 0, which the newcomer then
shares with gen-0 (the test reads its threads' CPUs in /proc). On SLURM the same requests start
and cancel jobs: tests/integration/slurm/test_slurm_backend.py.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from controller_status import controller_state
from local_run import leftovers, steps, write_config
from polling import until

from tandem.launcher.audit import audit
from tandem.launcher.run_info import run_info
from tandem.services.protocol import (
    ExpDir,
    read_metrics,
    read_service,
)

pytestmark = pytest.mark.timeout(600)


def scale(exp: ExpDir, *args: str) -> tuple[int, str]:
    """`tandem scale --exp EXP ARGS` as a user runs it: its exit code and output."""
    done = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "scale", "--exp", str(exp.root),
                           "--timeout", "300", *args], capture_output=True, text=True, timeout=330)
    return done.returncode, done.stdout + done.stderr


def controller_servers(exp: ExpDir) -> dict[str, dict]:
    return {s["address"].rstrip("/"): s for s in controller_state(exp)["servers"]}


def last_step(exp: ExpDir) -> int:
    done = steps(exp)
    return done[-1]["step"] if done else 0


def test_servers_join_and_leave_a_running_experiment(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "scale")
    exp = ExpDir(tmp_path / "scale")
    out_file = tmp_path / "launcher.out"
    with open(out_file, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg),
                                "trainer.total_steps=1000"], stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        # The controller at version 2 (not only the trainer's step record): a server joining now
        # holds older weights than the current ones, so it must be caught up.
        until("step 2", lambda: last_step(exp) >= 2)
        until("version 2", lambda: controller_state(exp)["version"] >= 2)
        code, text = scale(exp, "--add", "1")
        assert code == 1 and "every CPU of the run is in a pool" in text and "--cpus" in text, text

        code, text = scale(exp, "--add", "1", "--cpus", "0")
        assert code == 0, text
        assert "gen-1 joined the run" in text and "it shares CPUs with gen-0" in text and "in rotation" in text, text
        gen1 = read_service(exp, "gen-1")
        address = gen1["url"].rstrip("/")
        cpus = {line.split(":", 1)[1].strip() for line in Path(f"/proc/{gen1['pid']}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list")}
        assert cpus == {"0"}, cpus
        # Started from the base model while the run was at version >= 2: caught up from disk
        # before the controller put it in rotation.
        caught = [r for r in read_metrics(exp, "controller")
                  if r.get("event") == "catch_up" and r.get("server", "").rstrip("/") == address]
        assert caught and caught[0]["ok"] and caught[0]["version"] >= 2, caught
        until("gen-1 taking requests", lambda: controller_servers(exp)[address]["routed"] > 0)

        code, text = scale(exp, "--server", "gen-0")
        assert code == 0 and "gen-0 left the run" in text, text
        left_at = last_step(exp)
        assert list(controller_servers(exp)) == [address]
        code, text = scale(exp, "--remove", "1")
        assert code == 1 and "would leave generation with none" in text, text
        # Steps trained on gen-1's groups alone; then the run is stopped (SIGTERM: as Ctrl-C).
        until("3 steps more", lambda: last_step(exp) >= left_at + 3)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 130, out_file.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    result = audit(exp)
    assert not result.lost and not result.trained_twice, result.as_dict()
    assert [c["label"] for c in result.server_changes] == ["gen-1 joined", "gen-0 left"]
    assert [c["label"] for c in run_info(exp, read_metrics(exp)).server_changes] == ["gen-1 joined", "gen-0 left"]
    hist = steps(exp)[-1]["staleness_hist_total"]
    assert max(int(k) for k in hist) <= 2   # controller.max_staleness held throughout
    assert not leftovers(exp)
    code, text = scale(exp, "--add", "1")
    assert code == 2 and "is not running" in text, text
