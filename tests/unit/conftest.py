"""The unit tier's rule, enforced: a unit test starts no process and opens no real socket.

While a test under tests/unit is set up, run and torn down, every way this code base starts a
process or reaches the network is replaced by a function that raises `UnitTierViolation`
("unit tests start no processes/sockets: move <test> to tests/integration (<what it tried>)").
Allowed: threads, zmq `inproc://` endpoints, `socket.socketpair()` (asyncio's own wake-up pipe).

Why a guard and not a marker: a test that starts a process belongs in tests/integration, and a
marker put on by hand is forgotten; this fails the test the first time it forks. The guard wraps
pytest's setup/call/teardown hooks of every unit test rather than being a function-scoped autouse
fixture: session- and module-scoped fixtures are created before any function-scoped one, so a
shared fixture that started a server would slip past a fixture guard.
"""
from __future__ import annotations

import asyncio
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

NETWORK_FAMILIES = {socket.AF_INET, socket.AF_INET6, getattr(socket, "AF_UNIX", -1)}

# matplotlib builds its font cache on first import, asking `fc-list` (a process) where
# fontconfig is installed: on a fresh machine the report's unit tests would be refused for
# the library's one-off set-up, not for anything they do. Build it here, before any guard.
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.font_manager  # noqa: E402,F401


class UnitTierViolation(RuntimeError):
    """A unit test tried to start a process or open a network socket."""


def _refuse(nodeid: str, what: str):
    raise UnitTierViolation(
        f"unit tests start no processes/sockets: move {nodeid} to tests/integration ({what})")


def _process_starters(nodeid: str) -> list[tuple[object, str, object]]:
    def refuse(what):
        def blocked(*args, **kwargs):
            _refuse(nodeid, what)
        return blocked

    patches = [
        (subprocess.Popen, "__init__", refuse("subprocess.Popen")),
        (multiprocessing.process.BaseProcess, "start", refuse("multiprocessing start")),
        (asyncio, "create_subprocess_exec", refuse("asyncio.create_subprocess_exec")),
        (asyncio, "create_subprocess_shell", refuse("asyncio.create_subprocess_shell")),
        (os, "system", refuse("os.system")),
    ]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp"):
        if hasattr(os, name):
            patches.append((os, name, refuse(f"os.{name}")))
    return patches


def _socket_openers(nodeid: str) -> list[tuple[object, str, object]]:
    def guarded(method_name):
        original = getattr(socket.socket, method_name)

        def method(self, address, *args, **kwargs):
            if self.family in NETWORK_FAMILIES:
                _refuse(nodeid, f"socket.{method_name}({address!r})")
            return original(self, address, *args, **kwargs)
        return method

    patches = [(socket.socket, name, guarded(name)) for name in ("bind", "connect", "connect_ex")]
    try:
        import zmq
    except ImportError:
        return patches

    def zmq_guarded(method_name):
        original = getattr(zmq.Socket, method_name)

        def method(self, addr, *args, **kwargs):
            if not str(addr).startswith("inproc://"):
                _refuse(nodeid, f"zmq {method_name}({addr!r}); only inproc:// is allowed")
            return original(self, addr, *args, **kwargs)
        return method

    patches += [(zmq.Socket, name, zmq_guarded(name)) for name in ("bind", "connect")]
    return patches


@contextmanager
def no_processes_or_sockets(nodeid: str) -> Iterator[None]:
    """Within this block, starting a process or opening a non-inproc socket raises."""
    with pytest.MonkeyPatch.context() as mp:
        for target, name, replacement in _process_starters(nodeid) + _socket_openers(nodeid):
            mp.setattr(target, name, replacement)
        yield


UNIT_DIR = Path(__file__).resolve().parent


def _in_unit_tier(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(UNIT_DIR)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not _in_unit_tier(item):
        return (yield)
    with no_processes_or_sockets(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not _in_unit_tier(item):
        return (yield)
    with no_processes_or_sockets(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if not _in_unit_tier(item):
        return (yield)
    with no_processes_or_sockets(item.nodeid):
        return (yield)

