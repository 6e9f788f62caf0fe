"""Running `tandem run` on the local backend from a test: a small experiment file, the
launcher as a subprocess, its output, the trainer's steps, and what it left running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_starts import start, wait_or_kill

from benchmarks import faults
from benchmarks.faults import as_terminal_foreground
from tandem.services.protocol import ExpDir, read_metrics


def write_config(path: Path, model: Path, name: str, **extra: str) -> Path:
    path.write_text(f"""
experiment: {{name: {name}, model: {model}, exp_dir: {path.parent / name}}}
controller: {{max_staleness: 2, lease_s: 20}}
gen: {{num_servers: 1, threads: 1, metrics_interval_s: 0.5}}
rollout: {{dataset: "synthetic:math", n_samples: 2, max_new_tokens: 48, concurrency: 4, heartbeat_s: 1.0}}
reward: {{task: math, num_workers: 1}}
trainer: {{groups_per_step: 2, total_steps: 4, checkpoint_every: 1, max_tokens_per_mb: 4096}}
""")
    return path


def tandem(*args, **kw) -> subprocess.Popen:
    """The launcher as a terminal's foreground job would run it (Ctrl-C reaches it)."""
    return subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=as_terminal_foreground, **kw)


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"tandem run did not finish in {timeout}s:\n{out[-4000:]}")
    return out


def export(exp: ExpDir, out: Path, *args: str) -> dict:
    """`tandem export --exp EXP --json ARGS OUT` (process_starts.start: forked where it can be);
    the JSON it reported."""
    console = out.parent / f"{out.name}.export.log"
    console.write_text("")
    proc = start(["-m", "tandem.launcher.cli", "export", "--exp", str(exp.root), "--json", *args, str(out)], console)
    wait_or_kill(proc, 300)
    text = console.read_text()
    assert proc.returncode == 0, text[-3000:]
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def steps(exp: ExpDir) -> list[dict]:
    return read_metrics(exp, "trainer", "step")


def leftovers(exp: ExpDir) -> list[str]:
    """Processes whose command line names this experiment (roles started for it)."""
    return faults.leftovers(exp.root)
