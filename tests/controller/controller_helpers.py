"""Helpers of the controller tests: an experiment config, the controller as a real process, and a
recording stand-in for a generation server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from launcher.config import load_config, save_resolved
from services.protocol import ExpDir


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
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "controller", "--exp", str(self.exp.root)],
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

class RecordingGenServer:
    """A stand-in generation server: an aiohttp app on a free port that records every admin call.

    It exists because the weight-sync logic must be checked call by call (order, bodies, bearer
    key) and with injected failures, which a real server cannot be told to produce. It answers in
    SGLang 0.5.x's shapes. `fail` maps a path to the HTTP status to answer with.
    """

    def __init__(self, api_key: str | None = None, weight_version: str = "0"):
        self.api_key = api_key
        self.weight_version = weight_version
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.paused = False
        self.runner = None
        self.url = ""

    async def start(self) -> str:
        import asyncio

        from aiohttp import web

        async def handle(request):
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
            path = request.path
            if self.api_key and not path.startswith("/health") and \
                    request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            self.calls.append((path, body))
            await asyncio.sleep(self.delay.get(path, 0.0))
            if path in self.fail:
                status = self.fail[path]
                return web.json_response({"success": False, "message": f"injected failure of {path}"},
                                         status=status)
            if path == "/health":
                return web.Response(status=200)
            if path == "/get_server_info":
                return web.json_response({"weight_version": self.weight_version, "internal_states": [
                    {"num_running_reqs": 0, "num_waiting_reqs": 0}]})
            if path == "/get_model_info":
                return web.json_response({"model_path": "m", "weight_version": self.weight_version})
            if path == "/pause_generation":
                self.paused = True
                return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":
                self.paused = False
                return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
            if path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
                if "weight_version" in body:
                    self.weight_version = body["weight_version"]
                return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
            if path in ("/init_weights_update_group", "/destroy_weights_update_group"):
                return web.json_response({"success": True, "message": "ok"})
            if path == "/flush_cache":
                return web.Response(text="Cache flushed.", status=200)
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
        return [p for p, _ in self.calls if p not in ("/health", "/get_server_info")]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
