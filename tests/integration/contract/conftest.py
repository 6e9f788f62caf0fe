"""The contract tests' shared fixture: the pinned SGLang wheel, fetched once per session.

Skipped only when the package registry cannot be reached; every other problem (the pin is not
exact, no such release, pip refusing, the oracle failing on the wheel) fails the tests.
"""
from __future__ import annotations

import pytest
from sglang_wheel import RegistryUnreachable, Wheel, load_pinned_wheel


@pytest.fixture(scope="session")
def sglang_wheel() -> Wheel:
    try:
        return load_pinned_wheel()
    except RegistryUnreachable as e:
        pytest.skip(f"SGLang contract not checked: {e}")


@pytest.fixture(scope="session")
def sglang_routes(sglang_wheel) -> list[dict]:
    return sglang_wheel.ask("routes")["routes"]
