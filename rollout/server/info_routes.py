"""Health, readiness, load and information routes, with SGLang 0.5.23's semantics.

- `/health` and `/health_generate` (`entrypoints/http_server.py`, `health_generate`): a probe
  generation of one token, answering 200 as soon as the engine shows any progress after the
  call began, 503 after `SGLANG_HEALTH_CHECK_TIMEOUT` seconds (default 20) without any. The probe
  waits behind a pause like every request, so while generation is paused (and idle) it answers
  503 after the timeout. With `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0` (`environ.py`, default
  on) `/health` answers 200 at once without a probe; `/health_generate` always probes. A
  liveness check that must not stall during a weight sync therefore sets that variable.
- `/ready`: 200 while not paused and healthy, else 503 (`TokenizerManager.is_ready`).
- `/model_info` (and the deprecated `/get_model_info`): the *live* state, `weight_version`
  included — where a client reads the version the server holds after an update.
- `/server_info` (and `/get_server_info`): the start-up arguments (so its `weight_version`
  stays the start-up value, as in SGLang, whose docstring says so) plus `internal_states`.
- `/v1/loads` (`entrypoints/v1_loads.py`): `{timestamp, version, accelerator, num_accelerators,
  loads: [...]}`, one load per data-parallel rank (here always one, rank 0), `dp_rank`,
  `include` and `format=prometheus` query parameters.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import UTC, datetime

from aiohttp import web

from .engine import Request
from .sampling import BadRequest, SamplingParams

VERSION = "tandem-embedded-0.5.23"
HEALTH_POLL_S = 0.1
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
# LoadSnapshot's flat fields (sglang/srt/managers/load_snapshot.py), in its order.
CORE_LOAD_KEYS = ("timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
                  "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
                  "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput",
                  "cache_hit_rate", "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us",
                  "decode_moments")


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"${name}={raw!r} is not a valid boolean value")


def health_timeout_s() -> float:
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


class InfoRoutes:
    """Mixed into `GenServer` (which owns `engine`, `server_args`, `paused`, `open`, `served_version`)."""

    async def health(self, request):
        if not self.engine.alive():
            return web.Response(status=503)
        if request.path == "/health" and not env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True):
            return web.Response(status=200)
        tic = time.monotonic()
        probe = asyncio.ensure_future(self._health_probe())
        try:
            while time.monotonic() < tic + health_timeout_s():
                await asyncio.sleep(HEALTH_POLL_S)
                if self.engine.last_progress > tic:
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            probe.cancel()

    async def _health_probe(self) -> None:
        """One greedy token, after the pause gate like any request; skipped while the engine is
        busy (its running requests are the evidence then, as SGLang's scheduler does)."""
        await self.open.wait()
        load = self.engine.load()
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = Request(prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0),
                      on_done=lambda resp: loop.call_soon_threadsafe(_resolve, fut, resp),
                      rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        self.engine.submit([req])
        try:
            await fut
        except asyncio.CancelledError:
            self.engine.abort(rid=req.rid, message="health check timed out")
            raise

    async def ready(self, request):
        return web.Response(status=200 if self.engine.alive() and not self.paused else 503)

    async def model_info(self, request):
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.server_args.get("served_model_name",
                                                                                    self.server_args["model_path"]),
            "tokenizer_path": self.server_args["tokenizer_path"], "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.served_version, "load_format": None,
            "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request):
        load = self.engine.load()
        stats = self.engine.stats
        return web.json_response({
            **self.server_args,
            "context_length": self.engine.context_len, "max_req_input_len": self.engine.context_len - 1,
            "max_running_requests": self.engine.max_running,
            "internal_states": [{**load, "paused": self.paused, "updating": self.updating,
                                 "weight_update_session": self.session is not None,
                                 "generated_tokens": stats["generated_tokens"], "steps": stats["steps"],
                                 "prefill_tokens": stats["prefill_tokens"],
                                 "finished": stats["finished"], "aborted": stats["aborted"]}],
            "version": VERSION, "frontend": "python"})

    async def loads(self, request):
        q = request.query
        dp_rank = q.get("dp_rank")
        if dp_rank is not None:
            try:
                dp_rank = int(dp_rank)
            except ValueError:
                raise BadRequest(f"/v1/loads: dp_rank must be an integer, got {dp_rank!r}") from None
        include = [s.strip() for s in q["include"].split(",")] if q.get("include") else None
        if include is not None and not set(include) <= LOAD_SECTIONS:
            raise BadRequest(f"Invalid include sections: {set(include) - LOAD_SECTIONS}. "
                             f"Valid options: {sorted(LOAD_SECTIONS)}")
        loads = [] if dp_rank not in (None, 0) else [self._load(include)]
        if q.get("format") == "prometheus":
            return web.Response(body=_prometheus(loads).encode(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        return web.json_response({"timestamp": datetime.now(UTC).isoformat(), "version": VERSION,
                                  "accelerator": None, "num_accelerators": 0, "loads": loads})

    def _load(self, include: list[str] | None) -> dict:
        """One LoadSnapshot's dict: the fields a CPU server can honestly fill, the rest at
        LoadSnapshot's defaults (0, or None for decode_moments)."""
        e = self.engine
        state = e.load()
        used = state["num_tokens"]
        load = dict.fromkeys(CORE_LOAD_KEYS, 0)
        load.update(timestamp=time.time(), dp_rank=0, num_running_reqs=state["num_running_reqs"],
                    num_waiting_reqs=state["num_waiting_reqs"],
                    num_waiting_uncached_tokens=state["num_waiting_tokens"], num_used_tokens=used,
                    num_total_tokens=used + state["num_waiting_tokens"],
                    num_active_tokens=used + state["num_waiting_tokens"], max_running_requests=e.max_running,
                    token_usage=0.0, gen_throughput=round(state["gen_throughput"], 2),
                    cache_hit_rate=0.0, utilization=0.0, total_prefill_uncached_tokens=e.stats["prefill_tokens"],
                    decode_moments=None)
        every = include is None or "all" in include
        if every or "disagg" in include:
            load["disaggregation"] = {"mode": "null", "prefill_bootstrap_queue_reqs": 0,
                                      "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                      "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                      "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
        if every or "queues" in include:
            load["queues"] = {"waiting": state["num_waiting_reqs"], "grammar": 0, "paused": 0,
                              "retracted": state["num_retracted_reqs"], "prealloc_ready": 0}
        return load


def _prometheus(loads: list[dict]) -> str:
    """The loads as Prometheus gauges named like v1_loads.py's (`sglang_<field>`,
    `sglang_<section>_<field>`), labelled by dp_rank."""
    samples: dict[str, list] = {}
    for load in loads:
        load = dict(load)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = {"disaggregation": "disagg", "speculative": "spec"}.get(key, key)
                for sub, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, v))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values]
    return "\n".join(lines) + "\n"


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
