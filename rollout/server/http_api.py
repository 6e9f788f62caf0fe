"""The HTTP application: SGLang 0.5.23's RL subset of routes, with its auth levels (aiohttp).

The HTTP layer owns the admission gate: while generation is paused, or an update / session
change is waiting for in-flight requests to drain, new `/generate` calls wait here (as in
SGLang, whose tokenizer manager holds them on its pause condition and model-update lock)
instead of reaching the engine. Weight updates are serialised by one lock. The routes live in
`control_routes` (pause, abort, flush, weights, session), `info_routes` (health, readiness,
loads, model and server information) and `openai_routes` (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`); `auth` decides who may call them.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import ClientPayloadError, web

from . import auth, weights
from .auth import AuthLevel
from .control_routes import ControlRoutes
from .engine import Engine, Request
from .info_routes import InfoRoutes
from .lora_routes import LoraRoutes, ServedAdapters, request_adapter
from .openai_routes import OpenAIRoutes
from .requests import parse_generate, read_json, text_to_input_ids
from .sampling import BadRequest

log = logging.getLogger(__name__)
# How often a request's wait looks for its client gone (SGLang: SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s).
DISCONNECT_CHECK_S = 4.0
_N, _A = AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL
# Every route served: (methods, path, GenServer method, auth level), the level each route has in
# SGLang 0.5.23's entrypoints/http_server.py (its `@auth_level` decorators; none means NORMAL).
# Importable without a model, e.g. to compare with the pinned wheel's routes.
ROUTES: list[tuple[tuple[str, ...], str, str, AuthLevel]] = [
    (("POST", "PUT"), "/generate", "generate", _N),
    (("GET",), "/health", "health", _N),
    (("GET",), "/health_generate", "health", _N),
    (("GET",), "/ready", "ready", _N),
    (("GET",), "/model_info", "model_info", _N),
    (("GET",), "/get_model_info", "model_info", _N),
    (("GET",), "/server_info", "server_info", _N),
    (("GET",), "/get_server_info", "server_info", _N),
    (("GET",), "/v1/loads", "loads", _N),
    (("GET", "POST"), "/flush_cache", "flush_cache", _A),
    (("POST",), "/pause_generation", "pause", _A),
    (("POST",), "/continue_generation", "resume", _A),
    (("POST",), "/abort_request", "abort", _A),
    (("POST",), "/update_weights_from_disk", "update_from_disk", _A),
    (("POST",), "/init_weights_update_group", "init_group", _A),
    (("POST",), "/destroy_weights_update_group", "destroy_group", _A),
    (("POST",), "/begin_weight_update", "begin_weight_update", _A),
    (("POST",), "/end_weight_update", "end_weight_update", _A),
    (("POST",), "/update_weights_from_distributed", "update_from_distributed", _A),
    (("POST",), "/update_weight_version", "update_weight_version", _A),
    (("POST",), "/load_lora_adapter", "load_lora_adapter", _A),
    (("POST",), "/unload_lora_adapter", "unload_lora_adapter", _A),
    # The OpenAI-compatible API (openai_routes): NORMAL, as in the release.
    (("GET",), "/v1/models", "models", _N),
    (("POST",), "/v1/completions", "completions", _N),
    (("POST",), "/v1/chat/completions", "chat_completions", _N),
]


def error_body(message: str, code: int = 400) -> dict:
    """SGLang replies errors as `ErrorResponse` (validation) or `{"error": {"message"}}`; both fit here."""
    return {"object": "error", "message": message, "type": "Bad Request" if code == 400 else "Error",
            "param": None, "code": code, "error": {"message": message}}


class GenServer(ControlRoutes, InfoRoutes, OpenAIRoutes, LoraRoutes):
    def __init__(self, engine: Engine, *, api_key: str | None = None, admin_api_key: str | None = None,
                 server_args: dict | None = None):
        self.engine = engine
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.server_args = {k: v for k, v in (server_args or {}).items() if k not in ("api_key", "admin_api_key")}
        self.server_args.setdefault("model_path", engine.model_path)
        self.server_args.setdefault("tokenizer_path", engine.model_path)
        self.server_args.setdefault("weight_version", engine.weight_version)
        self.server_args.setdefault("enable_deterministic_inference", False)
        self.model_path = self.server_args["model_path"]    # live: moved by a disk update
        self.served_version = engine.weight_version          # live: what /model_info reports
        self.paused = False
        self.updating = False
        self.session: dict | None = None                     # the open weight-update session
        self.update_lock = asyncio.Lock()
        self.group = weights.BroadcastGroup()
        self.adapter_base = weights.AdapterBase()           # pre-adapter weights (server/lora.py)
        self.adapters = ServedAdapters(enabled=bool(self.server_args.get("enable_lora")))   # lora_routes.py
        self._open: asyncio.Event | None = None

    @property
    def open(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    def _reopen(self) -> None:
        if not self.paused and not self.updating:
            self.open.set()

    def app(self) -> web.Application:
        middlewares = [self._errors]
        if self.api_key or self.admin_api_key:     # as SGLang: no keys, no auth middleware at all
            middlewares.insert(0, auth.middleware(api_key=self.api_key, admin_api_key=self.admin_api_key,
                                                  levels={path: level for _, path, _, level in ROUTES}))
        app = web.Application(middlewares=middlewares, client_max_size=64 * 2**20)
        for methods, path, handler, _ in ROUTES:
            for method in methods:
                app.router.add_route(method, path, getattr(self, handler))
        return app

    # ---- middlewares ----------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            log.info("400 %s: %s", request.path, e)
            return web.json_response(error_body(str(e)), status=400)
        except web.HTTPException:
            raise
        except (ConnectionResetError, ClientPayloadError) as e:   # the client left mid-request
            log.info("%s: client went away (%s)", request.path, type(e).__name__)
            return web.json_response(error_body(f"client went away: {e}"), status=400)
        except Exception as e:
            log.exception("%s failed", request.path)
            return web.json_response(error_body(f"internal error: {e}", 500), status=500)

    # ---- generation -----------------------------------------------------------------------
    async def generate(self, request):
        body = await read_json(request)
        adapter = request_adapter(body)
        # Tokenizing text takes time in proportion to its length: off the event loop, so serving,
        # health checks and weight updates go on meanwhile.
        body = await asyncio.to_thread(text_to_input_ids, body, tokenizer=self.engine.tokenizer,
                                       context_len=self.engine.context_len)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []

        def on_done_factory(i):
            fut = loop.create_future()
            futures.append(fut)
            return lambda resp: loop.call_soon_threadsafe(_resolve, fut, resp)

        reqs, single = parse_generate(body, tokenizer=self.engine.tokenizer, vocab=self.engine.vocab_size,
                                      context_len=self.engine.context_len, on_done_factory=on_done_factory)
        results = await self._run(reqs, futures, adapter, request)
        return web.json_response(results[0] if single else results)

    async def _run(self, reqs: list[Request], futures: list[asyncio.Future], adapter: str | None = None,
                   request=None) -> list[dict]:
        await self.open.wait()
        await self.resolve_adapter(adapter)     # after the pause, as SGLang resolves lora_path
        try:
            await asyncio.wrap_future(self.engine.submit(reqs))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            # As SGLang (tokenizer_manager `_wait_one_response`): every DISCONNECT_CHECK_S of
            # waiting, a request whose client has gone is aborted. aiohttp cancels no handler on
            # a disconnect, so without this the work went on for a client long gone.
            while not all(f.done() for f in futures):
                await asyncio.wait(futures, timeout=DISCONNECT_CHECK_S)
                if request is not None and (request.transport is None or request.transport.is_closing()):
                    raise asyncio.CancelledError
            return [f.result() for f in futures]
        except asyncio.CancelledError:      # the client went away: stop spending compute on it
            for r in reqs:
                self.engine.abort(rid=r.rid, message="client disconnected")
            raise


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
