"""The integration tier: tests that start real processes, open real sockets, speak real HTTP or
need the local SLURM cluster. Everything collected under tests/integration gets the
`integration` marker, so `pytest -m "not integration"` and `make test-fast` (tests/unit) leave
it out; nothing here has to remember to mark itself. A test that uses the local SLURM cluster
(the `slurm_cluster` fixture, directly or through another fixture) also gets `slurm`.
"""
from __future__ import annotations

from pathlib import Path

import pytest

INTEGRATION_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)
            if "slurm_cluster" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.slurm)
