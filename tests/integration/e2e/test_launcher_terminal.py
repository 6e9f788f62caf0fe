"""`tandem run` outlives its terminal (launcher/console.py): the reader of its output goes away
mid-run — a pipe's reader exits, as `| head` does after its lines, or an ssh session drops — and
the run goes on, its output in `<exp>/logs/launcher.out`; then SIGHUP (the closed terminal's
signal) stops it as Ctrl-C does. Real processes, a real tiny run on the local backend. Before,
the first print after the reader left ended the run with BrokenPipeError, and the next one, in
the teardown, cut the teardown short."""
from __future__ import annotations

import os
import signal
import time

from local_run import leftovers, steps, tandem, write_config

from services.protocol import ExpDir


def _wait(condition, what: str, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f}s"
        time.sleep(0.2)


def test_a_run_goes_on_when_its_output_reader_is_gone_and_sighup_stops_it_cleanly(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "term")
    proc = tandem("run", cfg, "trainer.total_steps=400")
    exp = ExpDir(tmp_path / "term")
    out = exp.logs / "launcher.out"
    assert proc.stdout.readline()      # the launcher is printing to us ...
    proc.stdout.close()                # ... and we are gone
    _wait(lambda: out.exists() and "stdout is gone" in out.read_text(), "notice in launcher.out", proc)
    at = len(steps(exp))
    _wait(lambda: len(steps(exp)) >= at + 3 and f"step {at + 3}/400" in out.read_text(), "progress", proc)
    os.kill(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=300) == 130
    text = out.read_text()
    assert "interrupted; stopping every role" in text and "stopping the trainer" in text, text[-3000:]
    assert leftovers(exp) == []
    last = max(s["step"] for s in steps(exp))
    assert (exp.checkpoints / f"step-{last}").is_dir()   # the trainer saved its last step
