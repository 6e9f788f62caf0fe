"""Helpers for the generation tests: a stdlib HTTP client, the server subprocess, reference log-probs.

(A module with a unique name rather than conftest.py, so test modules can import it whatever
other conftest files the suite has.)
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import torch
from process_starts import gen_server

EXTERNAL_URL = os.environ.get("TANDEM_GEN_URL")
API_KEY = os.environ.get("TANDEM_GEN_API_KEY", "test-key-123") if EXTERNAL_URL else "test-key-123"


class Api:
    """Minimal blocking HTTP client for tests (stdlib only, so it cannot mask client bugs)."""

    def __init__(self, url: str, api_key: str | None):
        self.url, self.api_key = url.rstrip("/"), api_key

    def call(self, method: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = "default",
             timeout: float = 60.0):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        key = self.api_key if key == "default" else key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def get(self, path: str, **kw):
        return self.call("GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return self.call("POST", path, body if body is not None else {}, **kw)

    def generate(self, input_ids, **sampling):
        status, out = self.post("/generate", {"input_ids": input_ids, "sampling_params": sampling,
                                              "return_logprob": True})
        assert status == 200, out
        return out


class ServerProcess:
    """`tandem gen serve` on a free port (started by process_starts: forked from a preloaded
    interpreter where it can be), its output in `log`."""

    def __init__(self, model: Path, tmp: Path, api_key: str | None = API_KEY, extra: tuple = (),
                 admin_key: str | None = None, env: dict | None = None):
        argv = ["--model", str(model)]
        for flag, name, key in (("--api-key-file", "gen-api-key", api_key),
                                ("--admin-api-key-file", "gen-admin-key", admin_key)):
            if key:
                key_file = tmp / name
                key_file.write_text(key + "\n")
                key_file.chmod(0o600)
                argv += [flag, str(key_file)]
        self.log = tmp / "server.log"
        self.proc, self.url = gen_server(argv + list(extra), self.log, env, 120)
        self.api = Api(self.url, api_key)
        # the key for admin routes: the admin key when the server has one (the API key is refused)
        self.admin = Api(self.url, admin_key or api_key)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SHARED_RANK = 3
SHARED_MAX_RUNNING = 48


def reference_logprobs(model_dir, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token, the convention docs/generation.md states."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
    return [float(logp[p, t]) for p, t in zip(positions, output, strict=True)]
