"""free_port: a port a listener binds seconds later, so one the kernel will not hand to anyone
else meanwhile (a generation server once lost its port to the busy test suite beside it)."""
from __future__ import annotations

import socket

from tandem.services.protocol import transport


def test_the_port_is_free_and_below_the_kernels_ephemeral_range():
    low = transport._ephemeral_low()
    for _ in range(20):
        port = transport.free_port()
        assert transport.PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_port_in_use_is_never_given(monkeypatch):
    # Both candidates come from below the ephemeral range, where only free_port's own random
    # picks land: a port from the kernel's range (a bind to 0) had a neighbour any socket of the
    # busy suite could take meanwhile, and the test then saw the fallback's ports (CI, stop 54).
    low = transport._ephemeral_low()
    taken = next(p for p in (transport.free_port() for _ in range(100))
                 if p + 1 < low and _bindable(p + 1))
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        held.listen()
        monkeypatch.setattr(transport, "PORTS_FROM", taken)
        monkeypatch.setattr(transport, "_ephemeral_low", lambda: taken + 2)   # two candidates, one taken
        assert {transport.free_port() for _ in range(10)} == {taken + 1}


def test_with_nothing_free_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(transport, "_ephemeral_low", lambda: transport.PORTS_FROM)
    assert transport.free_port() > 0


def test_an_unreadable_range_is_linuxs_default(tmp_path):
    assert transport._ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert transport._ephemeral_low(str(tmp_path / "range")) == 40000
