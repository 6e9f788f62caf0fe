"""The routes that change the server: pause / continue / abort / flush, weight updates and the
weight-update session, with SGLang 0.5.23's bodies, replies and status codes.

Facts from the pinned release this module follows (file:line in its wheel, see docs/generation.md):
- `/update_weights_from_distributed` (and `_from_tensor`) only run inside a session opened by
  `/begin_weight_update` and closed by `/end_weight_update`; outside one the scheduler answers
  `success: false` with "update_weights_from_distributed must run between begin_weight_update()
  and end_weight_update()", which the route maps to 400 (scheduler_components/weight_updater.py,
  `update_weights_from_distributed`; http_server.py, the route). Nothing is received then, so a
  sender broadcasting anyway is left waiting, as on SGLang.
- A second begin while one is open, and an end without a begin, answer 400 with their messages
  (weight_updater.py, `begin_weight_update` / `end_weight_update`). Disk updates need no session.
- An update, begin or end while not paused first waits for every in-flight request to finish
  (the tokenizer manager's writer lock), holding new ones back; while paused it runs at once.
- After an update the server records the version change (the requests held across it get
  `weight_versions` spans) and flushes the KV cache (`flush_cache`, default true). With an
  `in_place` pause the running batch keeps its KV cache, so that flush is refused and the call
  answers 400 "Weights were updated, but the cache was not flushed ..." (weight_updater.py,
  `flush_cache_after_weight_update`) — the weights *are* updated and the spans switch version,
  but the version `/model_info` reports does not move (the tokenizer manager only records it on
  success). With `flush_cache: false` the update succeeds and the stale cache stays in use.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from . import expert_weights, weights
from .requests import field, read_json
from .sampling import BadRequest

log = logging.getLogger(__name__)
OUTSIDE_SESSION = ("{} must run between begin_weight_update() and end_weight_update()")
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running "
                 "or queued. Retract or finish them, then call /flush_cache.")
SELECTORS = ("target", "draft", "all")


class ControlRoutes:
    """Mixed into `GenServer` (which owns `engine`, `paused`, `updating`, `open`, `update_lock`,
    `group`, `session`, `served_version`, `model_path`, `adapter_base`)."""

    # ---- pause / abort / flush ------------------------------------------------------------
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

    async def flush_cache(self, request):
        ok = await asyncio.wrap_future(self.engine.flush_cache())
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)\n") if ok else "Flush cache failed.\n"
        return web.Response(text=text, status=200 if ok else 400)

    # ---- exclusive sections ---------------------------------------------------------------
    async def _exclusive(self, fn):
        """Run `fn` on the engine thread with nothing generating: at once when paused, else after
        the in-flight requests finish, holding new `/generate` calls back meanwhile."""
        self.updating = True
        self.open.clear()
        try:
            return await asyncio.wrap_future(self.engine.when_idle(fn))
        finally:
            self.updating = False
            self._reopen()

    async def _apply(self, update, version: str | None, flush_cache: bool) -> bool:
        model, engine, base = self.engine.model, self.engine, self.adapter_base
        return await self._exclusive(lambda: engine.apply_update(lambda: weights.apply(model, update, base),
                                                                 version, flush_cache))

    # ---- session ---------------------------------------------------------------------------
    async def begin_weight_update(self, request):
        body = await read_json(request, required=False)
        selector = field(body, "selector", str, "all", "/begin_weight_update")
        if selector not in SELECTORS:
            raise BadRequest(f"/begin_weight_update.selector must be one of {list(SELECTORS)}, got {selector!r}")
        async with self.update_lock:
            def begin():
                if self.session is not None:
                    return False
                self.session = {"selector": selector}
                return True
            if not await self._exclusive(begin):
                return _result(False, "a weight-update session is already open; call end_weight_update() first")
        return _result(True, "Success")

    async def end_weight_update(self, request):
        await read_json(request, required=False)
        async with self.update_lock:
            def end():
                was_open, self.session = self.session is not None, None
                return was_open
            if not await self._exclusive(end):
                return _result(False, "no weight-update session is open; call begin_weight_update() first")
        return _result(True, "Success")

    # ---- weight updates ---------------------------------------------------------------------
    async def update_from_disk(self, request):
        where = "/update_weights_from_disk"
        body = await read_json(request)
        path = field(body, "model_path", str, where=where)
        version = _version(body, where)
        flush = field(body, "flush_cache", bool, True, where)
        if field(body, "abort_all_requests", bool, False, where):
            self.engine.abort(abort_all=True, message="Aborted for a weight update")
        async with self.update_lock:
            t0 = time.time()
            try:
                update = await asyncio.get_running_loop().run_in_executor(
                    None, weights.load_from_disk, self.engine.model, path)
            except weights.WeightError as e:
                return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                          "num_paused_requests": 0}, status=400)
            flushed = await self._apply(update, version, flush)
            if not flushed:
                return web.json_response({"success": False, "message": FLUSH_REFUSED,
                                          "num_paused_requests": 0}, status=400)
            self.model_path = path
            self._served(version)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        log.info("weights from %s (version %s) in %.2fs", path, self.served_version, time.time() - t0)
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def update_from_distributed(self, request):
        where = "/update_weights_from_distributed"
        body = await read_json(request)
        names = field(body, "names", list, where=where)
        dtypes = field(body, "dtypes", list, where=where)
        shapes = field(body, "shapes", list, where=where)
        group = field(body, "group_name", str, "weight_update_group", where)
        version = _version(body, where)
        flush = field(body, "flush_cache", bool, True, where)
        selector = field(body, "selector", str, "all", where)
        if selector not in SELECTORS:
            raise BadRequest(f"{where}.selector must be one of {list(SELECTORS)}, got {selector!r}")
        if field(body, "abort_all_requests", bool, False, where):
            self.engine.abort(abort_all=True, message="Aborted for a weight update")
        async with self.update_lock:
            if self.session is None:
                return _result(False, OUTSIDE_SESSION.format("update_weights_from_distributed"))
            try:
                # Receive while still generating; only the copy into the model needs the gate.
                state = await asyncio.get_running_loop().run_in_executor(
                    None, self.group.receive, group, names, dtypes, shapes)
                # a MoE model's experts arrive in the Hub's names, one tensor each (expert_weights.py)
                state = expert_weights.served(self.engine.model, state, partial=True, error=weights.WeightError)
                weights.validate(self.engine.model, state, partial=True)
            except weights.WeightError as e:
                return _result(False, f"Failed to receive weights: {e}")
            if not await self._apply(state, version, flush):
                return _result(False, FLUSH_REFUSED)
            self._served(version)
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return _result(True, msg)

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
            return _result(False, f"Failed to init group: {e}")
        return _result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request):
        body = await read_json(request, required=False)
        name = field(body, "group_name", str, "weight_update_group", "/destroy_weights_update_group")
        try:
            self.group.destroy(name)
        except weights.WeightError as e:
            return _result(False, str(e))
        return _result(True, "Succeeded to destroy custom process group.")

    async def update_weight_version(self, request):
        body = await read_json(request)
        version = _version(body, "/update_weight_version", key="new_version")
        if version is None:
            raise BadRequest("/update_weight_version: missing required field 'new_version'")
        if field(body, "abort_all_requests", bool, True, "/update_weight_version"):
            await asyncio.wrap_future(self.engine.abort(abort_all=True, message="Aborted for a weight version update"))
        await asyncio.wrap_future(self.engine.call(lambda: self.engine.record_version_change(version)))
        self._served(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    def _served(self, version: str | None) -> None:
        """The version /model_info reports: moved only by a successful update that names one."""
        if version is not None:
            self.served_version = version


def _result(success: bool, message: str):
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _version(body: dict, where: str, key: str = "weight_version") -> str | None:
    v = field(body, key, (str, int), None, where)
    return None if v is None else str(v)
