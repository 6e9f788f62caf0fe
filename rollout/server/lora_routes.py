"""SGLang 0.5.23's LoRA adapter routes on a server that merges one adapter into its model.

SGLang serves many adapters side by side; a request names one in `lora_path` (none: the base
model). This server computes with one set of weights, so it serves one adapter at a time,
merged (rollout/server/lora.py), and follows SGLang wherever a Tandem run can tell:

- `--lora-paths NAME=PATH ...` loads adapters at start (and turns LoRA on, as `--enable-lora`
  does); without either, the adapter routes and `lora_path` are refused with SGLang's messages.
- `/load_lora_adapter {lora_name, lora_path, pinned}` and `/unload_lora_adapter {lora_name}`
  answer `LoRAUpdateOutput` {success, error_message, loaded_adapters: {name: path}}, 400 on
  failure: a name already loaded, an unknown one, an adapter that does not fit (the rank and
  target modules the first adapter set, as SGLang's memory pool does).
- A load does not move `weight_version` (only `/update_weight_version` and the weight updates
  do: tokenizer_control_mixin.py).
- An unload stops new requests naming the adapter at once, then waits for the requests already
  using it to finish (lora_registry.py `unregister`, `wait_for_unload`): here the unmerge waits
  for every running request, as weight updates do, and while one adapter is loaded every
  running request uses it.
- A request naming an adapter that was loaded once and unloaded since has it loaded again from
  its path (tokenizer_manager.py `_resolve_lora_path`, `lora_ref_cache`); a name never loaded is
  refused. Requests wait out a pause before their adapter name is looked up (`generate_request`).

Where this server differs: a second adapter cannot be loaded beside the first (400 naming the
one loaded), and while one is loaded a request must name it — the base model is not served
beside it (400). A Tandem run names its one adapter in every request
(services/controller/weights/adapter.py), so neither is reached there.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from . import weights
from .lora import Adapter
from .requests import field, read_json
from .sampling import BadRequest

log = logging.getLogger(__name__)
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def parse_lora_paths(values: list[str] | None) -> dict[str, str]:
    """SGLang's `--lora-paths` (`NAME=PATH`, or `PATH` named by itself) -> {name: path}."""
    out = {}
    for value in values or []:
        name, _, path = value.partition("=") if "=" in value else (value, "", value)
        if not name or not path:
            raise ValueError(f"--lora-paths {value!r}: expected NAME=PATH")
        out[name] = path
    return out


class ServedAdapters:
    """SGLang's LoRA registry as this server keeps it: the loaded (merged) adapter, and every
    adapter ever loaded (to reload an unloaded one a request names)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.loaded: dict[str, Adapter] = {}
        self.ever: dict[str, str] = {}          # name -> path (SGLang's lora_ref_cache)
        self.lock = asyncio.Lock()              # loads and unloads, one at a time (lora_update_lock)
        self.limits: tuple[int, frozenset[str]] | None = None   # rank, modules: the first adapter's


class LoraRoutes:
    """Mixed into `GenServer` (which owns `engine`, `adapters`, and control_routes' `_apply`, which
    merges an adapter under the same drain as any weight update)."""

    async def load_initial_adapters(self, lora_paths: dict[str, str]) -> None:
        for name, path in lora_paths.items():
            error = await self._load_adapter(name, path)
            if error:
                raise ValueError(f"--lora-paths {name}={path}: {error}")

    async def load_lora_adapter(self, request):
        body = await read_json(request)
        name = field(body, "lora_name", str, where="/load_lora_adapter")
        path = field(body, "lora_path", str, where="/load_lora_adapter")
        field(body, "pinned", bool, False, "/load_lora_adapter")
        if not self.adapters.enabled:
            return self._lora_reply(NOT_ENABLED)
        return self._lora_reply(await self._load_adapter(name, path))

    async def unload_lora_adapter(self, request):
        body = await read_json(request)
        name = field(body, "lora_name", str, where="/unload_lora_adapter")
        reg = self.adapters
        if not reg.enabled:
            return self._lora_reply(NOT_ENABLED)
        async with reg.lock:
            if name not in reg.loaded:
                return self._lora_reply(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(reg.loaded)}")
            del reg.loaded[name]                    # new requests naming it are refused from now on
            await self._apply(Adapter(source="", scale=0.0, pairs={}), None, True)   # back to the base
        log.info("LoRA adapter %s unloaded (serving the base model)", name)
        return self._lora_reply(None)

    async def _load_adapter(self, name: str, path: str) -> str | None:
        """Load and merge one adapter; the error message SGLang would give, or None."""
        async with self.adapters.lock:
            return await self._load_adapter_locked(name, path)

    async def _load_adapter_locked(self, name: str, path: str) -> str | None:
        reg = self.adapters
        if name in reg.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if reg.loaded:
            return (f"the embedded server serves one LoRA adapter at a time and {next(iter(reg.loaded))!r} is "
                    f"loaded: unload it first (SGLang serves several side by side)")
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(
                None, weights.load_adapter, self.engine.model, path, self.engine.model_path)
        except weights.WeightError as e:
            return f"Failed to load LoRA adapter {name}: {e}"
        modules = frozenset(n.rsplit(".", 2)[-2] for n in adapter.pairs)
        if reg.limits is None:
            reg.limits = (adapter.rank, modules)
        elif adapter.rank > reg.limits[0] or not modules <= reg.limits[1]:
            return (f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory "
                    f"pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    f"`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        await self._apply(adapter, None, True)
        reg.loaded[name], reg.ever[name] = adapter, str(Path(path))
        log.info("LoRA adapter %s loaded from %s (merged)", name, path)
        return None

    async def resolve_adapter(self, name: str | None) -> None:
        """Check a request's `lora_path` after any pause (reloading an unloaded adapter it names)."""
        reg = self.adapters
        if name is None:
            if reg.loaded:
                raise BadRequest(f"the embedded server has LoRA adapter {next(iter(reg.loaded))!r} merged into its "
                                 f"model and does not serve the base model beside it: name the adapter in "
                                 f"lora_path")
            return
        if not reg.enabled:
            raise BadRequest(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
                             f"server with --enable-lora flag and preload adapters using --lora-paths or "
                             f"/load_lora_adapter endpoint.")
        if name not in reg.loaded:
            if name not in reg.ever:
                raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: {list(reg.ever)}.")
            log.info("Reloading evicted adapter: %s", name)
            error = await self._load_adapter(name, reg.ever[name])
            if error and "already loaded" not in error:
                raise BadRequest(f"Failed to implicitly load LoRA adapter {name}: {error}")

    def _lora_reply(self, error: str | None):
        loaded = {name: self.adapters.ever[name] for name in self.adapters.loaded}
        return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if error is None else 400)


def request_adapter(body: dict, where: str = "/generate") -> str | None:
    """The adapter a request names (`lora_path`: a name, or one per prompt, all the same here);
    removed from `body`."""
    value = body.pop("lora_path", None)
    if isinstance(value, list):
        if not all(v is None or isinstance(v, str) for v in value):
            raise BadRequest(f"{where}.lora_path must hold adapter names (strings), got {value!r:.60}")
        names = set(value)
        if len(names) > 1:
            raise BadRequest(f"{where}.lora_path names {len(names)} adapters; the embedded server serves one")
        value = next(iter(names), None)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where}.lora_path must be an adapter name (a string), got {value!r:.60}")
    return value
