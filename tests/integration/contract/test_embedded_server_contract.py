"""The embedded server against the pinned release: the same routes, auth levels and refusals.

Every route the embedded server's aiohttp application serves must exist in 0.5.23's
`http_server.py` (or a router it includes) with the same method. Then a real `tandem gen serve`
(tiny model, an API key and an admin key in 0600 files, as the launcher starts it) is probed on
every one of those routes, and on a path no server has, with no key, the API key and the admin
key: it must refuse exactly when SGLang's own `decide_request_auth` refuses at the route's
`@auth_level`, with the same status (401/403) and body, and must not refuse otherwise. Bodies
sent where the call is allowed are a JSON array, which no route accepts, so probes change nothing.

Its replies (a real `/generate`, and every GET route answering a JSON object) go through the
same reply checks as the recorder's: `/generate` must decode as the release's
`api_types.GenerateResponse`, other replies may carry only keys the release's endpoint sends —
unless `docs/generation.md` names the key (in backticks) as a documented difference.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import types
import urllib.error
import urllib.request

import pytest
from process_starts import gen_server
from sglang_wheel import REPO

pytestmark = pytest.mark.timeout(600)

API_KEY, ADMIN_KEY = "embedded-api-key", "embedded-admin-key"
DEPLOYMENT = {"api and admin keys": {"api_key": API_KEY, "admin_api_key": ADMIN_KEY}}
NO_SUCH_PATH = "/no_such_route_anywhere"


def embedded_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the embedded server's application registers (no model
    needed: the application is built around a stand-in engine and never started)."""
    from tandem.rollout.server.http_api import GenServer

    engine = types.SimpleNamespace(model_path="/models/tiny", weight_version="0")
    app = GenServer(engine, api_key=API_KEY).app()
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "OPTIONS", "*"):
            out.add((route.method, path))
    return sorted(out, key=lambda r: (r[1], r[0]))


def test_every_embedded_route_exists_in_the_release(sglang_routes, sglang_wheel):
    served = embedded_routes()
    assert served, "the embedded application registers no route"
    problems = []
    for method, path in served:
        same = [r for r in sglang_routes if r["path"] == path]
        if not same:
            problems.append(f"{method} {path}: no such route in sglang/srt/entrypoints/http_server.py "
                            f"(nor in the routers it includes)")
        elif not any(method in r["methods"] for r in same):
            problems.append(f"{method} {path}: the release serves it with {sorted({m for r in same for m in r['methods']})} "
                            f"only ({same[0]['file']}:{same[0]['line']})")
    assert not problems, f"embedded server routes vs {sglang_wheel.name}:\n  " + "\n  ".join(problems)


class EmbeddedServer:
    """`tandem gen serve` with both keys in 0600 files; `url` once it prints where it serves."""

    def __init__(self, model, tmp):
        files = []
        for name, key in (("api", API_KEY), ("admin", ADMIN_KEY)):
            f = tmp / f"{name}-key"
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(key + "\n")
            files.append(f)
        self.log = tmp / "server.log"
        self.proc, self.url = gen_server(["--model", str(model), "--host", "127.0.0.1", "--api-key-file",
                                          str(files[0]), "--admin-api-key-file", str(files[1])], self.log)

    def call(self, method: str, path: str, key: str | None, body=None) -> tuple[int, object]:
        """`body` is sent as JSON; POST/PUT without one send `[]`, a body no route accepts."""
        data = json.dumps(body).encode() if body is not None else (b"[]" if method in ("POST", "PUT") else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def embedded(tiny_model_dir, tmp_path_factory):
    server = EmbeddedServer(tiny_model_dir, tmp_path_factory.mktemp("embedded-contract"))
    yield server
    server.stop()


def test_the_embedded_server_refuses_exactly_when_the_release_does(embedded, sglang_wheel):
    name = next(iter(DEPLOYMENT))
    probes = [{"method": m, "path": p, "authorization": f"Bearer {k}" if k else None, "deployment": name, "key": label}
              for m, p in [*embedded_routes(), ("GET", NO_SUCH_PATH)]
              for label, k in (("no key", None), ("the API key", API_KEY), ("the admin key", ADMIN_KEY))]
    verdicts = sglang_wheel.ask("decide-auth", {"deployments": DEPLOYMENT, "probes": probes})["verdicts"]
    assert any(v["refused"] for v in verdicts) and any(v["refused"] is None for v in verdicts), verdicts
    # refusals first: they change nothing; then the allowed probes (their bodies are refused as malformed)
    order = sorted(range(len(probes)), key=lambda i: verdicts[i]["refused"] is None)
    problems = []
    for i in order:
        probe, want = probes[i], verdicts[i]
        status, body = embedded.call(probe["method"], probe["path"], probe["authorization"] and probe["authorization"][7:])
        what = (f"{probe['method']} {probe['path']} with {probe['key']} (SGLang: {want['level']}"
                f"{', ' + want['where'] if want['where'] else ''})")
        if want["refused"] is not None:
            expect = {"error": "Unauthorized" if want["refused"] == 401 else "Forbidden"}
            if status != want["refused"] or body != expect:
                problems.append(f"{what}: SGLang refuses with {want['refused']} {expect}, the embedded server "
                                f"answered {status} {str(body)[:200]}")
        elif status in (401, 403):
            problems.append(f"{what}: SGLang lets it through, the embedded server refused with {status}")
        elif not want["route"] and status != 404:
            problems.append(f"{what}: no such route: SGLang answers 404, the embedded server {status}")
    assert not problems, (f"embedded server auth vs {sglang_wheel.name} (both keys set):\n  "
                          + "\n  ".join(problems))


def test_the_embedded_servers_replies_have_the_releases_shape(embedded, sglang_wheel):
    calls = []
    for method, path in embedded_routes():
        if method == "GET" and not path.startswith(("/health", "/ready")):
            status, body = embedded.call("GET", path, API_KEY)
            if status == 200 and isinstance(body, dict):
                calls.append({"method": "GET", "path": path, "body": None, "reply": body})
    request = {"input_ids": [1, 5, 57, 50], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
               "return_logprob": True}
    status, reply = embedded.call("POST", "/generate", API_KEY, body=request)
    assert status == 200, reply
    calls.append({"method": "POST", "path": "/generate", "body": request, "content_type": "application/json",
                  "reply": reply})
    for c in calls:
        c.update(authorization=f"Bearer {API_KEY}", deployment=next(iter(DEPLOYMENT)))
    assert {"/generate", "/model_info", "/v1/loads"} <= {c["path"] for c in calls}, [c["path"] for c in calls]
    answer = sglang_wheel.ask("check-calls", {"deployments": DEPLOYMENT, "calls": calls,
                                              "replier": "the embedded server"})
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", (REPO / "docs" / "generation.md").read_text()))
    problems = []
    for c, verdict in zip(calls, answer["calls"], strict=True):
        for p in verdict["problems"]:
            key = re.search(r"has key `(\w+)`", p)
            if key is None or key.group(1) not in documented:
                problems.append(f"{c['method']} {c['path']}: {p}")
    assert not problems, (f"embedded server replies vs {sglang_wheel.name} (a key the release never sends is "
                          f"fine only when docs/generation.md names it as a difference):\n  " + "\n  ".join(problems))
