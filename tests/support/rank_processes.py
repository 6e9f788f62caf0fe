"""The processes of a multi-rank job started by a test (the variables the launcher gives trainer
ranks), and waiting on them: every rank's failure, not only the first (a rank that dies
leaves its peers to time out in a collective)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from process_starts import start, wait_or_kill

from tandem.launcher.backends.local_ranks import rank_env
from tandem.services.protocol import free_port


def start_ranks(command: list[str], logs: Path, name: str, world: int = 2,
                env: dict[str, str] | None = None) -> tuple[list, list[Path]]:
    """`world` ranks of `python COMMAND` (process_starts.start) with the variables the launcher
    gives a trainer's ranks (rank_env), rank r's output in `logs/NAME.rank{r}.log`; returns the
    processes and those files."""
    # The trainer meets its ranks through a rendezvous file, as the launcher gives it; workers of
    # the tests that call init_process_group themselves (env://) through MASTER_ADDR/MASTER_PORT.
    port = free_port()
    store = logs / f".{name}-store-{port}"
    procs, consoles = [], []
    for rank in range(world):
        console = logs / f"{name}.rank{rank}.log"
        console.write_text("")
        procs.append(start(command, console, {**(env or {}), **rank_env(rank, world, str(store)),
                                              "MASTER_PORT": str(port)}))
        consoles.append(console)
    return procs, consoles


def rank_errors(procs: list, consoles: list[Path], timeout_s: float = 240) -> list[str]:
    """The last 3,000 characters of the output of each rank that failed or hung (then killed)."""
    errors = []
    for p, console in zip(procs, consoles, strict=True):
        wait_or_kill(p, timeout_s)
        if p.returncode:
            errors.append(f"{console.name} (exit {p.returncode}):\n{console.read_text()[-3000:]}")
    return errors


def tails(consoles: list[Path]) -> str:
    """The last 3,000 characters of each rank's output, for an assertion's message."""
    return "\n".join(console.read_text()[-3000:] for console in consoles)


def reap(procs: list) -> None:
    """Kill what is still running of a job's ranks, and the helpers each rank started in its own
    process group (dist_checkpointing's writer processes)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
