"""What befalls a running `tandem run` from outside, in one real tiny run on the local backend:
a second launch of the same experiment is refused before it changes anything (launcher/
exp_lock.py; before, a `--resume` next to a running launch rewrote the servers' API keys and
started a second set of roles); the reader of the launcher's output goes away — a pipe's reader
exits, as `| head` does after its lines, or an ssh session drops — and the run goes on, its
output in `<exp>/logs/launcher.out` (launcher/console.py; before, the first print after the
reader left ended the run with BrokenPipeError, and the next, in the teardown, cut it short);
then SIGHUP (the closed terminal's signal) stops it as Ctrl-C does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from local_run import leftovers, steps, tandem, write_config

from tandem.services.protocol import ExpDir


def _wait(condition, what: str, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f}s"
        time.sleep(0.2)


def test_a_second_launch_is_refused_the_output_outlives_its_reader_and_sighup_stops_the_run(tmp_path,
                                                                                             tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "term")
    proc = tandem("run", cfg, "trainer.total_steps=400")
    exp = ExpDir(tmp_path / "term")
    out = exp.logs / "launcher.out"
    assert proc.stdout.readline()      # the launcher is printing to us ...
    _wait(lambda: len(steps(exp)) >= 1, "a first step", proc)
    files = {p: p.read_bytes() for p in (exp.root / "config.yaml", *exp.keys.iterdir())}
    second = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg), "--resume",
                             "trainer.total_steps=400"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and f"is in use by another launch (pid {proc.pid} on " in second.stderr, \
        second.stderr[-2000:]
    assert {p: p.read_bytes() for p in files} == files   # nothing of the running launch touched
    status = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "status", "--exp", str(exp.root)],
                            capture_output=True, text=True, timeout=120)
    assert f"launch running (pid {proc.pid} on " in status.stdout and " of 400, " in status.stdout, status.stdout
    assert "roles running here: \n" in status.stdout and "trainer --exp" in status.stdout, status.stdout
    proc.stdout.close()                # ... and we are gone
    _wait(lambda: out.exists() and "stdout is gone" in out.read_text(), "notice in launcher.out", proc)
    at = len(steps(exp))
    _wait(lambda: len(steps(exp)) >= at + 3 and f"step {at + 3}/400" in out.read_text(), "progress", proc)
    os.kill(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=300) == 130
    text = out.read_text()
    assert "interrupted; stopping every role" in text and "stopping the trainer" in text, text[-3000:]
    assert leftovers(exp) == []
    status = subprocess.run([sys.executable, "-m", "tandem.launcher.cli", "status", "--exp", str(exp.root)],
                            capture_output=True, text=True, timeout=120)
    assert f"no launch running (the last: pid {proc.pid} on " in status.stdout, status.stdout
    assert "roles running here: none" in status.stdout, status.stdout
    last = max(s["step"] for s in steps(exp))
    assert (exp.checkpoints / f"step-{last}").is_dir()   # the trainer saved its last step
