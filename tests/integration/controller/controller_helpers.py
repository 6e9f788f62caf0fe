"""Helpers of the controller tests: an experiment config, the controller as a real process, and a
recording stand-in for a generation server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tandem.launcher.config import load_config, save_resolved
from tandem.services.protocol import ExpDir


def write_config(exp: ExpDir, **controller) -> None:
    """`<exp>/config.yaml` with the given `controller.*` (and `trainer.groups_per_step` as B)."""
    overrides = ["experiment.name=controller-test", "experiment.model=/nonexistent",
                 f"experiment.exp_dir={exp.root}"]
    if "groups_per_step" in controller:
        overrides.append(f"trainer.groups_per_step={controller.pop('groups_per_step')}")
    overrides += [f"controller.{k}={v}" for k, v in controller.items()]
    save_resolved(load_config(None, overrides), exp.root)


class ControllerProcess:
    """`tandem controller --exp DIR` in a subprocess; `start()` waits for its announcement."""

    def __init__(self, exp: ExpDir):
        self.exp = exp
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        log = open(self.exp.root / "controller-stderr.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "controller", "--exp", str(self.exp.root)],
                                     stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        path = self.exp.service_file("controller")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}:\n{self.stderr()}")
            try:
                info = json.loads(path.read_text())
                if info.get("pid") == self.proc.pid:
                    return info["address"]
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"controller did not announce itself in {timeout_s}s:\n{self.stderr()}")

    def stderr(self) -> str:
        p = self.exp.root / "controller-stderr.log"
        return p.read_text()[-4000:] if p.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else 0

# SGLang 0.5.23's NORMAL-level routes this stand-in serves (utils/auth.py: the API key; every
# other route it serves is ADMIN_OPTIONAL: the admin key when one is set, else the API key).
NORMAL_ROUTES = ("/model_info", "/server_info", "/v1/loads", "/generate")
# Calls the health check makes (left out of `paths()`, which lists the weight-sync calls).
POLLS = ("/health", "/model_info", "/server_info", "/v1/loads")


class RecordingGenServer:
    """A stand-in generation server: an aiohttp app on a free port that records every admin call.

    It exists because the weight-sync logic must be checked call by call (order, bodies, which
    key) and with injected failures, which a real server cannot be told to produce. It answers in
    SGLang 0.5.23's shapes and keeps its rules: auth levels (`utils/auth.py`), weight-update
    sessions (`/update_weights_from_distributed` answers 400 outside begin/end, a second begin
    400), the live `weight_version` in `/model_info` while `/server_info` keeps the start-up
    value, load per DP rank in `/v1/loads`. `fail` maps a path to the HTTP status to answer with;
    `delay` a path to seconds to wait first (`/health` delayed = SGLang's generation probe
    stalled by a pause); `gate` a path to an asyncio.Event its calls wait for (an update held
    until the test says, as a drain holds a non-interruptible update).
    """

    def __init__(self, api_key: str | None = None, weight_version: str = "0", admin_key: str | None = None,
                 tp_size: int = 1, load: tuple[int, ...] = (0, 0)):
        self.api_key, self.admin_key = api_key, admin_key
        self.weight_version = weight_version
        self.startup_version = weight_version
        self.tp_size = tp_size
        # (running, waiting) per DP rank, flattened: (r0, w0, r1, w1, ...)
        self.load = load
        self.calls: list[tuple[str, dict]] = []
        self.keys: list[tuple[str, str | None]] = []
        self.fail: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.gate: dict = {}
        self.paused = False
        self.session = False
        self.runner = None
        self.url = ""

    def _allowed(self, path: str, header: str | None) -> int:
        if path.startswith("/health"):
            return 200
        if path in NORMAL_ROUTES:
            want = self.api_key
        else:
            want = self.admin_key or self.api_key
        if want and header != f"Bearer {want}":
            return 401
        return 200

    async def start(self) -> str:
        import asyncio

        from aiohttp import web

        async def handle(request):
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
            path = request.path
            header = request.headers.get("Authorization")
            if self._allowed(path, header) != 200:
                return web.json_response({"error": "Unauthorized"}, status=401)
            self.calls.append((path, body))
            self.keys.append((path, header.removeprefix("Bearer ") if header else None))
            await asyncio.sleep(self.delay.get(path, 0.0))
            if path in self.gate:
                await self.gate[path].wait()
            if path in self.fail:
                status = self.fail[path]
                return web.json_response({"success": False, "message": f"injected failure of {path}"},
                                         status=status)
            if path == "/health":
                return web.Response(status=200)
            if path == "/model_info":
                return web.json_response({"model_path": "m", "weight_version": self.weight_version})
            if path == "/server_info":
                return web.json_response({"weight_version": self.startup_version, "tp_size": self.tp_size,
                                          "internal_states": [{}]})
            if path == "/v1/loads":
                ranks = [{"dp_rank": i // 2, "num_running_reqs": self.load[i], "num_waiting_reqs": self.load[i + 1]}
                         for i in range(0, len(self.load), 2)]
                return web.json_response({"timestamp": "t", "version": "0.5.23", "loads": ranks})
            if path == "/pause_generation":
                self.paused = True
                return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":
                self.paused = False
                return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
            if path == "/begin_weight_update":
                if self.session:
                    return web.json_response({"success": False, "message": "a weight-update session is already "
                                              "open; call end_weight_update() first"}, status=400)
                self.session = True
                return web.json_response({"success": True, "message": "Success"})
            if path == "/end_weight_update":
                if not self.session:
                    return web.json_response({"success": False, "message": "no weight-update session is open"},
                                             status=400)
                self.session = False
                return web.json_response({"success": True, "message": "Success"})
            if path == "/update_weights_from_distributed" and not self.session:
                return web.json_response({"success": False, "message": "update_weights_from_distributed must run "
                                          "between begin_weight_update() and end_weight_update()"}, status=400)
            if path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
                if "weight_version" in body:
                    self.weight_version = body["weight_version"]
                return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
            if path in ("/init_weights_update_group", "/destroy_weights_update_group"):
                return web.json_response({"success": True, "message": "ok"})
            if path == "/flush_cache":
                return web.Response(text="Cache flushed.", status=200)
            if path == "/abort_request":
                return web.Response(status=200)
            return web.Response(status=404)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def paths(self) -> list[str]:
        """The calls other than the health check's polls, in order."""
        return [p for p, _ in self.calls if p not in POLLS]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
