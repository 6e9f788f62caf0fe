"""A real reward service process (`tandem reward serve --exp DIR`) shared by a test module."""
from __future__ import annotations

import pytest
from reward_service_helpers import REWARD_OVERRIDES, start_service, stop_service


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("reward") / "exp", REWARD_OVERRIDES)
    yield svc
    stop_service(svc)
