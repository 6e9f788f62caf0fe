"""Shared by the in-process controller tests: a Controller on a test experiment, and stand-in
generation servers (RecordingGenServer) registered with it."""
from __future__ import annotations

import asyncio

from controller_helpers import RecordingGenServer

from tandem.services.config import ControllerConfig
from tandem.services.controller.server import Controller
from tandem.services.protocol import MetricsWriter, RegisterServer

KEY = "secret-key-for-tests"
ADMIN_KEY = "admin-key-for-tests"


def make_controller(exp, **kw) -> Controller:
    (exp.keys / "gen-api-key").write_text(KEY + "\n")
    (exp.keys / "gen-admin-api-key").write_text(ADMIN_KEY + "\n")
    cfg = ControllerConfig(**{"groups_per_step": 2, "max_staleness": 0, "health_interval_s": 3600,
                              "http_timeout_s": 5.0, "update_timeout_s": 10.0, "broadcast_backend": "gloo", **kw})
    c = Controller(cfg, exp)
    c.restore()
    c.metrics = MetricsWriter(exp, "controller")
    return c


async def servers(n: int, **kw) -> list[RecordingGenServer]:
    out = [RecordingGenServer(api_key=KEY, **kw) for _ in range(n)]
    for s in out:
        await s.start()
    return out


async def settle(c: Controller) -> None:
    """Wait for the controller's background checks (and the catch-ups they start)."""
    while c._tasks:
        await asyncio.gather(*list(c._tasks))


async def register(c: Controller, gens: list[RecordingGenServer], tp_sizes: list[int] | None = None) -> None:
    for i, g in enumerate(gens):
        admin = "gen-admin-api-key" if g.admin_key else ""
        tp = tp_sizes[i] if tp_sizes else 0
        c.register_server(RegisterServer(address=g.url, api_key_ref="gen-api-key", admin_key_ref=admin, tp_size=tp))
    await settle(c)


async def shutdown(c: Controller, gens: list[RecordingGenServer]) -> None:
    for g in gens:
        await g.stop()
    if c._http is not None:
        await c._http.close()
