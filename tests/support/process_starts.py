"""Processes a test starts (generation servers, trainer and Megatron ranks), forked from one
interpreter per pytest process that has imported torch, transformers and megatron-core.

Why: the suite is bound by CPU on two cores, and these processes spend most of theirs importing:
a Megatron rank about 9 CPU-seconds for megatron-core and torch before a step that takes one, a
generation server about 5. The mechanism is the product's own (launcher/backends/role_forks.py,
what `tandem run` uses on the local backend), whose tests (test_role_forks.py) show that a fork
is its own process, session, console, environment and command line, run as `python -m` runs it.

What a test gets: an object with `pid`, `poll`, `wait`, `terminate`, `kill`, `returncode`, as from
`subprocess.Popen`, its output (stdout and stderr) appended to a console file. Commands are
`-m MODULE ARGS` (the Megatron workers of tests/integration/megatron and the SGLang oracles of
tests/integration/contract are modules on PYTHONPATH).
Each environment, as read at import (PYTHON*, HF_*, TANDEM_EMULATE_NCCL, ...), has its own server.
A fresh interpreter is started instead with a GPU build of torch, or where a server failed.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.launcher.backends.role_forks import READ_AT_IMPORT, ForkedRole, RoleForks, gpu_build_of_torch

MEGATRON_WORKERS = Path(__file__).resolve().parents[1] / "integration" / "megatron"
SGLANG_ORACLES = Path(__file__).resolve().parents[1] / "integration" / "contract"
ALSO_PRELOAD = ("megatron.core", "tandem.trainer.megatron.backend")
# What every started process gets on top of the test's environment (and the server has too, so
# that the processes' variables read at import equal the server's).
BASE = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(MEGATRON_WORKERS), str(SGLANG_ORACLES),
                                                    os.environ.get("PYTHONPATH")]))}

# One server per environment as read at import (a test that sets such a variable, e.g.
# TANDEM_EMULATE_NCCL, gets one that imported with it), started on first use.
_servers: dict[tuple, RoleForks] = {}


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **BASE, **(env or {})}


def start(command: list[str], console: Path, env: dict[str, str] | None = None) -> ForkedRole | subprocess.Popen:
    """Start `python COMMAND` (`command` without the interpreter) with the test's environment,
    BASE and `env`, in its own session, its output appended to `console`."""
    full_env = environment(env)
    if not gpu_build_of_torch():
        read_at_import = tuple(sorted((k, v) for k, v in full_env.items() if k.startswith(READ_AT_IMPORT)))
        if read_at_import not in _servers:
            console_dir = Path(tempfile.mkdtemp(prefix="tandem-test-forks-"))
            _servers[read_at_import] = RoleForks(console_dir / "role-forks.console",
                                                 {**environment(), **dict(read_at_import)}, ALSO_PRELOAD)
            atexit.register(shutil.rmtree, console_dir, ignore_errors=True)   # (runs after close)
            atexit.register(_servers[read_at_import].close)
        proc = _servers[read_at_import].spawn(command, full_env, console)
        if proc is not None:
            return proc
    with open(console, "ab") as out:
        return subprocess.Popen([sys.executable, *command], env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_or_kill(proc, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `proc`; kill it if it is still running then. Whether it ended
    on its own."""
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def first_line(proc, console: Path, prefix: str, timeout_s: float = 150) -> str:
    """The first line of `console` that starts with `prefix` (e.g. a server's "serving on URL"),
    waited for while `proc` runs; "" when it exited or the time ran out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = proc.poll() is None
        line = next((w for w in console.read_text(errors="replace").splitlines() if w.startswith(prefix)), "")
        if line or not running:
            return line
        time.sleep(0.05)
    return ""


def gen_server(args: list[str], console: Path, env: dict[str, str] | None = None, timeout_s: float = 150):
    """`tandem gen serve --port 0 ARGS` (start): the process and the URL its "serving on URL"
    line names; RuntimeError with the end of its output when it does not come up."""
    console.write_text("")
    proc = start(["-m", "tandem.launcher.cli", "gen", "serve", "--port", "0", *args], console,
                 {"TANDEM_THREADS": "1", **(env or {})})
    line = first_line(proc, console, "serving on ", timeout_s)
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the generation server did not start:\n{console.read_text()[-3000:]}")
    return proc, line.split()[-1].rstrip("/")
