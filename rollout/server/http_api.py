"""The HTTP routes: SGLang 0.5.x's RL subset, same paths, bodies and replies (aiohttp).

The HTTP layer owns the admission gate: while generation is paused, or a weight update is
waiting for in-flight requests to drain, new `/generate` calls wait here (as in SGLang) instead
of reaching the engine. Weight updates are serialised by one lock.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from . import weights
from .engine import Engine, Request
from .requests import field, parse_generate, read_json
from .sampling import BadRequest, SamplingParams

log = logging.getLogger(__name__)
VERSION = "tandem-embedded-0.5"
HEALTH_TIMEOUT_S = 20.0


def error_body(message: str, code: int = 400) -> dict:
    """SGLang replies errors as `ErrorResponse` (validation) or `{"error": {"message"}}`; both fit here."""
    return {"object": "error", "message": message, "type": "Bad Request" if code == 400 else "Error",
            "param": None, "code": code, "error": {"message": message}}


class GenServer:
    def __init__(self, engine: Engine, *, api_key: str | None = None, server_args: dict | None = None):
        self.engine = engine
        self.api_key = api_key
        self.server_args = dict(server_args or {})
        self.server_args.setdefault("model_path", engine.model_path)
        self.server_args.setdefault("tokenizer_path", engine.model_path)
        self.paused = False
        self.updating = False
        self.update_lock = asyncio.Lock()
        self.group = weights.BroadcastGroup()
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
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 * 2**20)
        r = app.router
        for path, fn in (("/generate", self.generate), ):
            r.add_post(path, fn)
            r.add_put(path, fn)
        for path, fn in (("/health", self.health), ("/health_generate", self.health_generate),
                         ("/get_model_info", self.model_info), ("/get_server_info", self.server_info),
                         ("/get_weight_version", self.weight_version), ("/flush_cache", self.flush_cache)):
            r.add_get(path, fn)
        for path, fn in (("/flush_cache", self.flush_cache), ("/pause_generation", self.pause),
                         ("/continue_generation", self.resume), ("/abort_request", self.abort),
                         ("/update_weights_from_disk", self.update_from_disk),
                         ("/init_weights_update_group", self.init_group),
                         ("/destroy_weights_update_group", self.destroy_group),
                         ("/update_weights_from_distributed", self.update_from_distributed),
                         ("/update_weight_version", self.update_weight_version)):
            r.add_post(path, fn)
        return app

    # ---- middlewares ----------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key and request.method != "OPTIONS" and not request.path.startswith(("/health", "/metrics")):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            log.info("400 %s: %s", request.path, e)
            return web.json_response(error_body(str(e)), status=400)
        except web.HTTPException:
            raise
        except Exception as e:
            log.exception("%s failed", request.path)
            return web.json_response(error_body(f"internal error: {e}", 500), status=500)

    # ---- generation -----------------------------------------------------------------------
    async def generate(self, request):
        body = await read_json(request)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []

        def on_done_factory(i):
            fut = loop.create_future()
            futures.append(fut)
            return lambda resp: loop.call_soon_threadsafe(_resolve, fut, resp)

        reqs, single = parse_generate(body, tokenizer=self.engine.tokenizer, vocab=self.engine.vocab_size,
                                      context_len=self.engine.context_len, on_done_factory=on_done_factory)
        results = await self._run(reqs, futures)
        return web.json_response(results[0] if single else results)

    async def _run(self, reqs: list[Request], futures: list[asyncio.Future]) -> list[dict]:
        await self.open.wait()
        try:
            await asyncio.wrap_future(self.engine.submit(reqs))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:      # the client went away: stop spending compute on it
            for r in reqs:
                self.engine.abort(rid=r.rid, message="client disconnected")
            raise

    async def health(self, request):
        return web.Response(status=200 if self.engine.alive() else 503)

    async def health_generate(self, request):
        if not self.engine.alive():
            return web.Response(status=503)
        load = self.engine.load()
        if self.paused or self.updating or load["num_running_reqs"] or load["num_waiting_reqs"]:
            # Busy (or deliberately paused): a live engine thread is the health signal.
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = Request(prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0),
                      on_done=lambda resp: loop.call_soon_threadsafe(_resolve, fut, resp),
                      rid=f"HEALTH_CHECK_{time.time()}")
        try:
            self.engine.submit([req])
            await asyncio.wait_for(fut, HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    # ---- information ----------------------------------------------------------------------
    async def model_info(self, request):
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.server_args["model_path"], "tokenizer_path": self.server_args["tokenizer_path"],
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request):
        load = self.engine.load()
        stats = self.engine.stats
        return web.json_response({
            **{k: v for k, v in self.server_args.items() if k != "api_key"},
            "context_length": self.engine.context_len, "max_req_input_len": self.engine.context_len - 1,
            "max_running_requests": self.engine.max_running, "weight_version": self.engine.weight_version,
            "internal_states": [{**load, "paused": self.paused, "updating": self.updating,
                                 "generated_tokens": stats["generated_tokens"], "steps": stats["steps"],
                                 "prefill_tokens": stats["prefill_tokens"],
                                 "finished": stats["finished"], "aborted": stats["aborted"]}],
            "version": VERSION})

    async def weight_version(self, request):
        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, request):
        ok = await asyncio.wrap_future(self.engine.flush_cache())
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n",
                            status=200 if ok else 400)

    # ---- pause / abort --------------------------------------------------------------------
    async def pause(self, request):
        body = await read_json(request, required=False)
        mode = field(body, "mode", str, "abort", "/pause_generation")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"/pause_generation.mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        self.paused = True
        self.open.clear()
        await asyncio.wrap_future(self.engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request):
        self.paused = False
        await asyncio.wrap_future(self.engine.resume())
        self._reopen()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request):
        body = await read_json(request, required=False)
        rid = field(body, "rid", str, "", "/abort_request")
        abort_all = field(body, "abort_all", bool, False, "/abort_request")
        await asyncio.wrap_future(self.engine.abort(rid=rid, abort_all=abort_all))
        return web.Response(status=200)

    # ---- weights --------------------------------------------------------------------------
    async def _swap(self, state: dict, version: str | None, abort_all: bool) -> int:
        """Close the gate, let in-flight work drain (or stay held if paused), apply, reopen."""
        self.updating = True
        self.open.clear()
        try:
            if abort_all:
                await asyncio.wrap_future(self.engine.abort(abort_all=True, message="Aborted for a weight update"))
            load = self.engine.load()
            held = load["num_running_reqs"] + load["num_waiting_reqs"] if self.engine.paused else 0
            model = self.engine.model

            def apply():
                weights.apply(model, state)
                return version
            await asyncio.wrap_future(self.engine.update_weights(apply))
            return held
        finally:
            self.updating = False
            self._reopen()

    async def update_from_disk(self, request):
        where = "/update_weights_from_disk"
        body = await read_json(request)
        path = field(body, "model_path", str, where=where)
        version = _version(body, where)
        abort_all = field(body, "abort_all_requests", bool, False, where)
        async with self.update_lock:
            t0 = time.time()
            try:
                state = await asyncio.get_running_loop().run_in_executor(
                    None, weights.load_from_disk, self.engine.model, path)
            except weights.WeightError as e:
                return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                          "num_paused_requests": 0}, status=400)
            held = await self._swap(state, version, abort_all)
            self.server_args["model_path"] = path
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        log.info("weights from %s (version %s) in %.2fs", path, self.engine.weight_version, time.time() - t0)
        return web.json_response({"success": True, "message": msg, "num_paused_requests": held})

    async def init_group(self, request):
        where = "/init_weights_update_group"
        body = await read_json(request)
        args = dict(master_address=field(body, "master_address", str, where=where),
                    master_port=field(body, "master_port", int, where=where),
                    rank_offset=field(body, "rank_offset", int, where=where),
                    world_size=field(body, "world_size", int, where=where),
                    group_name=field(body, "group_name", str, "weight_update_group", where),
                    backend=field(body, "backend", str, "nccl", where))
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.group.init(**args))
        except Exception as e:
            return web.json_response({"success": False, "message": f"Failed to init group: {e}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request):
        body = await read_json(request, required=False)
        name = field(body, "group_name", str, "weight_update_group", "/destroy_weights_update_group")
        try:
            self.group.destroy(name)
        except weights.WeightError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_from_distributed(self, request):
        where = "/update_weights_from_distributed"
        body = await read_json(request)
        names = field(body, "names", list, where=where)
        dtypes = field(body, "dtypes", list, where=where)
        shapes = field(body, "shapes", list, where=where)
        group = field(body, "group_name", str, "weight_update_group", where)
        version = _version(body, where)
        abort_all = field(body, "abort_all_requests", bool, False, where)
        async with self.update_lock:
            try:
                # Receive while still generating; only the copy into the model needs the gate.
                state = await asyncio.get_running_loop().run_in_executor(
                    None, self.group.receive, group, names, dtypes, shapes)
                weights.validate(self.engine.model, state, partial=True)
            except weights.WeightError as e:
                return web.json_response({"success": False, "message": f"Failed to update parameter: {e}"},
                                         status=400)
            await self._swap(state, version, abort_all)
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": msg})

    async def update_weight_version(self, request):
        body = await read_json(request)
        version = _version(body, "/update_weight_version", key="new_version")
        if version is None:
            raise BadRequest("/update_weight_version: missing required field 'new_version'")
        if field(body, "abort_all_requests", bool, True, "/update_weight_version"):
            await asyncio.wrap_future(self.engine.abort(abort_all=True, message="Aborted for a weight version update"))

        def set_version():
            self.engine.weight_version = version
        await asyncio.wrap_future(self.engine.call(set_version))
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})


def _version(body: dict, where: str, key: str = "weight_version") -> str | None:
    v = field(body, key, (str, int), None, where)
    return None if v is None else str(v)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
