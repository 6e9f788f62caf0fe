"""Fixtures for the controller tests (helpers live in controller_helpers.py)."""
from __future__ import annotations

import pytest
from controller_helpers import ControllerProcess


@pytest.fixture
def controller_proc(exp):
    procs: list[ControllerProcess] = []

    def make() -> ControllerProcess:
        p = ControllerProcess(exp)
        procs.append(p)
        return p
    yield make
    for p in procs:
        p.kill()
