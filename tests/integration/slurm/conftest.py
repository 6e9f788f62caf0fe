"""The local SLURM cluster (slurm/local-cluster/start.sh) for the tests that need real SLURM.

Started once per session and stopped at the end. It needs root and apt (to install the SLURM
packages on a fresh machine, as in CI); without them those tests are skipped with the reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[3] / "slurm" / "local-cluster"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (it installs packages and starts daemons)"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return "the local SLURM cluster needs apt-get to install slurm (Debian/Ubuntu)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    started = subprocess.run([str(CLUSTER / "start.sh")], capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        pytest.fail(f"start.sh failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
    yield "tandem"   # the partition
    subprocess.run([str(CLUSTER / "stop.sh")], capture_output=True, text=True, timeout=300)


@pytest.fixture
def shared_exp(slurm_cluster, tmp_path_factory):
    """An experiment directory the jobs can write (pytest's tmp is on this machine's disk, which
    is the 'shared filesystem' of the local cluster)."""
    from tandem.services.protocol import ExpDir, generate_keys

    e = ExpDir(tmp_path_factory.mktemp("slurm") / "exp")
    e.root.mkdir(parents=True)
    generate_keys(e.keys)
    return e
