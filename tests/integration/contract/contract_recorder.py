"""A recording stand-in for an SGLang 0.5.23 server: real HTTP (aiohttp), every call captured.

The contract tests run Tandem's real client code against it and hand the captured calls —
method, path, query, JSON body, content type, Authorization header — to the oracle, which
judges them with SGLang's own code. It answers every route the way 0.5.23's
`entrypoints/http_server.py` does (reply shapes noted per route below) so the client proceeds
through its whole sequence; it does not check keys or bodies itself — that is the oracle's job,
so a wrong call is reported with the wheel's reasons instead of being refused here. Its replies
are themselves checked by the oracle: `/generate` against `api_types.GenerateResponse`, the
other JSON replies for keys the release's endpoint never sends.

`generate_script` scripts the next `/generate` replies: "complete" (the default), "abort"
(half the budget, then finish_reason abort, as a pause in abort mode returns a request),
"span" (completes, but its tokens straddle a weight update: two `weight_versions` spans, as
after a retract/in-place pause) and "503" (a server failure: the client fails over and aborts
the request id).
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Call:
    method: str
    path: str
    query: dict
    body: object
    content_type: str
    authorization: str | None
    deployment: str = ""
    origin: str = ""
    reply: object = None

    def as_json(self) -> dict:
        return {"method": self.method, "path": self.path, "query": self.query, "body": self.body,
                "content_type": self.content_type, "authorization": self.authorization,
                "deployment": self.deployment, "origin": self.origin, "reply": self.reply}


@dataclass
class RecordingSGLang:
    deployment: str
    weight_version: str = "0"
    startup_version: str = "0"
    generate_script: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    # LoRA adapters loaded (name -> path), as a server started with --enable-lora keeps them.
    adapters: dict[str, str] = field(default_factory=dict)
    # What the test is running now (e.g. "AdminClient.pause_generation(mode='abort')"): stamped on calls.
    origin: str = ""
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = raw.decode(errors="replace")
        call = Call(request.method, request.path, dict(request.query), body,
                    request.headers.get("Content-Type", ""), request.headers.get("Authorization"),
                    self.deployment, self.origin)
        self.calls.append(call)
        status, reply = self._answer(request.method, request.path, body if isinstance(body, dict) else {})
        if status == 200:
            call.reply = reply
        if reply is None:
            return web.Response(status=status)
        if isinstance(reply, str):
            return web.Response(status=status, text=reply)
        return web.json_response(reply, status=status)

    def _answer(self, method: str, path: str, body: dict) -> tuple[int, object]:
        ok = {"success": True, "message": "Succeeded."}
        if path == "/generate":
            return self._generate(body)
        if path in ("/health", "/health_generate", "/ready", "/abort_request"):
            return 200, None                                   # empty 200 (http_server.py)
        if path in ("/pause_generation", "/continue_generation"):
            verb = "paused" if path == "/pause_generation" else "continued"
            return 200, {"message": f"Generation {verb} successfully.", "status": "ok"}
        if path == "/flush_cache":
            return 200, "Cache flushed.\n"                     # plain text
        if path in ("/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor"):
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            return 200, {**ok, "num_paused_requests": 0} if path.endswith("disk") else ok
        if path in ("/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
                    "/end_weight_update", "/update_weight_version"):
            if path == "/update_weight_version" and body.get("new_version") is not None:
                self.weight_version = str(body["new_version"])
            return 200, ok
        if path in ("/load_lora_adapter", "/unload_lora_adapter"):
            return self._lora(path, body)
        if path in ("/model_info", "/get_model_info"):
            # the live version: `/model_info` reads tokenizer_manager's weight_version
            return 200, {"model_path": "/models/policy", "tokenizer_path": "/models/policy", "is_generation": True,
                         "weight_version": self.weight_version, "load_format": "auto"}
        if path in ("/server_info", "/get_server_info"):
            # start-up server args (weight_version stays the start-up value) + scheduler state
            return 200, {"model_path": "/models/policy", "tp_size": 1, "dp_size": 1, "api_key": None,
                         "weight_version": self.startup_version, "enable_deterministic_inference": True,
                         "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.23", "frontend": "python"}
        if path == "/v1/loads":
            return 200, {"timestamp": "2026-01-01T00:00:00+00:00", "version": "0.5.23", "accelerator": None,
                         "num_accelerators": 1, "loads": [{"timestamp": time.time(), "dp_rank": 0,
                                                           "num_running_reqs": 1, "num_waiting_reqs": 2,
                                                           "num_used_tokens": 0, "max_running_requests": 8}]}
        return 404, {"detail": "Not Found"}

    def _lora(self, path: str, body: dict) -> tuple[int, object]:
        """`LoRAUpdateOutput` {success, error_message, loaded_adapters}, 400 on failure (http_server.py);
        the messages of lora_manager.py `validate_new_adapter` and lora_registry.py `unregister`."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        error = None
        if path == "/load_lora_adapter":
            if name in self.adapters:
                error = f"Failed to load LoRA adapter {name} because it is already loaded"
            else:
                self.adapters[name] = body.get("lora_path")
        elif name not in self.adapters:
            error = f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self.adapters)})"
        else:
            del self.adapters[name]
        return (400 if error else 200), {"success": error is None, "error_message": error,
                                         "loaded_adapters": dict(self.adapters)}

    def _generate(self, body: dict) -> tuple[int, object]:
        mode = self.generate_script.pop(0) if self.generate_script else "complete"
        if mode == "503":
            return 503, {"error": {"message": "scripted failure", "code": 503}}
        params = body.get("sampling_params") or {}
        budget = int(params.get("max_new_tokens") or 128)
        n = max(1, budget // 2) if mode == "abort" else budget
        ids = [(7 + i) % 50 for i in range(n)]
        version = self.weight_version
        spans = [{"version": version, "start": 0, "end": n}]
        if mode == "span" and n >= 2:
            prev = str(int(version) - 1) if version.isdigit() and int(version) > 0 else "0"
            spans = [{"version": prev, "start": 0, "end": n // 2}, {"version": version, "start": n // 2, "end": n}]
        finish = ({"type": "abort", "message": "Abort request due to pause_generation."} if mode == "abort"
                  else {"type": "length", "length": n})
        meta = {"id": body.get("rid") or "rid", "finish_reason": finish,
                "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": n, "cached_tokens": 0,
                "output_token_logprobs": [[-0.25, t, None] for t in ids], "weight_version": version,
                "weight_versions": spans, "e2e_latency": 0.01}
        if body.get("return_routed_experts"):
            # SGLang 0.5.23: base64 int32 (positions, layers, top_k) over [start_len, seqlen - 1);
            # here 2 layers x top-2 (what the contract test's client is told)
            rows = len(body.get("input_ids") or []) + n - 1 - int(body.get("routed_experts_start_len") or 0)
            meta["routed_experts"] = base64.b64encode(bytes(4 * 2 * 2 * max(rows, 0))).decode()
        return 200, {"text": "", "output_ids": ids, "meta_info": meta}
