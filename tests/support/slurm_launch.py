"""Launching stand-in role stacks through the real lifecycle and SLURM backend (tests only).

The real role commands need the whole system; the SLURM tests give roles stand-in commands and
their own job shapes, and run them exactly as `tandem run` would: `run_experiment` with a
`SlurmBackend`."""
from __future__ import annotations

from tandem.launcher.backends.slurm import SlurmBackend
from tandem.launcher.backends.slurm_requests import JobRequest
from tandem.launcher.lifecycle import run_experiment
from tandem.launcher.roles import Role


def job(name: str, command: list[str], kind: str = "cpu", ready_file: str | None = None,
        restart: bool = False, threads: int = 1, **sizing) -> JobRequest:
    """A JobRequest for a role with the given command (`sizing`: nodes, gpus_per_node, ...)."""
    return JobRequest(Role(name, command, kind=kind, threads=threads, ready_file=ready_file, restart=restart),
                      **sizing)


def launch(cfg, exp, resume: bool, requests: list[JobRequest], policy, join=None) -> int:
    """`tandem run` with these jobs as the experiment's roles; `join` as in run_experiment."""
    return run_experiment(cfg, exp, resume, SlurmBackend(cfg, exp, policy, requests),
                          roles=[r.role for r in requests], join=join)
