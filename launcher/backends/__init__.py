"""Where a run's roles run: `local` (subprocesses of the launcher) or `slurm` (one job per role).

The factory lives here, not in `base`, so the base never imports the backends built on it.
"""
from __future__ import annotations

from tandem.services.protocol import ExpDir

from ..config import ExperimentConfig
from .base import Backend, Ended, LaunchError, RoleFailed

__all__ = ["Backend", "Ended", "LaunchError", "RoleFailed", "backend_for"]


def backend_for(cfg: ExperimentConfig, exp: ExpDir) -> Backend:
    """The backend `launcher.backend` names."""
    if cfg.launcher.backend == "slurm":
        from .slurm import SlurmBackend
        return SlurmBackend(cfg, exp)
    from .local import LocalBackend
    return LocalBackend(cfg, exp)
