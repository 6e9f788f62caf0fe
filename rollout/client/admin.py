"""An async client for the administrative endpoints of a generation server (SGLang 0.5.23's API).

The controller drives weight updates through it; the same calls work against SGLang and the
embedded server. Request bodies carry only fields SGLang's request classes define (its
`managers/io_struct.py`: `PauseGenerationReqInput`, `ContinueGenerationReqInput`,
`UpdateWeightFromDiskReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`,
`DestroyWeightsUpdateGroupReqInput`, `AbortReq`), and only the ones that differ from SGLang's
defaults, so a server reads them the same way whatever its defaults become.

Keys follow SGLang's `utils/auth.py`: the control routes are ADMIN_OPTIONAL (with
`--admin-api-key` set they want that key and refuse the API key), information routes are
NORMAL (the API key). So the client holds both and sends the right one per route; without an
admin key it sends the API key everywhere (a server started with `--api-key` only).

Replies follow `entrypoints/http_server.py`: weight and session calls answer
`{"success", "message"}` with 200 or 400; pause/continue `{"message", "status"}`; `/flush_cache`
text with 200 or 400; `/model_info` the live `weight_version`; `/v1/loads` one load record per
data-parallel rank. Every failure raises `AdminError` naming the server, the endpoint and what
it said; nothing fails silently.
"""
from __future__ import annotations

import json
import logging

import aiohttp

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class AdminError(RuntimeError):
    """A generation server refused or failed an administrative call (or could not be reached)."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None):
        super().__init__(f"{url}{endpoint}: {message}")
        self.url, self.endpoint, self.status, self.detail = url, endpoint, status, message


class AdminClient:
    """One generation server's admin API. `timeout_s` bounds each call unless one is given.

    `api_key` unlocks SGLang's NORMAL routes, `admin_key` its ADMIN_OPTIONAL ones (the API key
    is used there when no admin key is given).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 30.0,
                 session: aiohttp.ClientSession | None = None, admin_key: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.timeout_s = timeout_s
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._own_session = True
        return self._session

    async def _call(self, method: str, endpoint: str, body: dict | None = None,
                    timeout_s: float | None = None, admin: bool = True) -> tuple[int, str]:
        key = (self.admin_key or self.api_key) if admin else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._http().request(method, self.url + endpoint, json=body, headers=headers,
                                            timeout=timeout) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise AdminError(self.url, endpoint, f"{type(e).__name__}: {e}".rstrip(": ")) from None

    def _refused(self, endpoint: str, status: int, admin: bool) -> AdminError:
        which = "admin key" if admin and self.admin_key else "API key"
        what = "unauthorized" if status == 401 else "forbidden (the server has no admin key set)"
        return AdminError(self.url, endpoint, f"{what}: wrong or missing {which}", status)

    async def _json(self, method: str, endpoint: str, body: dict | None = None,
                    timeout_s: float | None = None, admin: bool = True) -> dict:
        status, text = await self._call(method, endpoint, body, timeout_s, admin)
        reply = _parse(text)
        if status in (401, 403):
            raise self._refused(endpoint, status, admin)
        if status != 200 or not isinstance(reply, dict):
            raise AdminError(self.url, endpoint, f"HTTP {status}: {_message(reply, text)}", status)
        return reply

    async def _success(self, endpoint: str, body: dict, timeout_s: float | None) -> dict:
        """Weight and session calls: success only if HTTP 200 and `success` is true."""
        status, text = await self._call("POST", endpoint, body, timeout_s)
        reply = _parse(text)
        if status in (401, 403):
            raise self._refused(endpoint, status, True)
        if not isinstance(reply, dict) or status != 200 or reply.get("success") is not True:
            raise AdminError(self.url, endpoint, f"HTTP {status}: {_message(reply, text)}", status)
        return reply

    # ---- generation control (admin key) --------------------------------------------------
    async def pause_generation(self, mode: str = "abort", timeout_s: float | None = None) -> dict:
        """abort: in-flight requests return at once with what they have (finish_reason abort);
        retract: they stay queued on the server and resume after continue (KV recomputed);
        in_place: they stay in the running batch with their KV cache."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {PAUSE_MODES}, got {mode!r}")
        return await self._json("POST", "/pause_generation", {"mode": mode}, timeout_s)

    async def continue_generation(self, timeout_s: float | None = None) -> dict:
        return await self._json("POST", "/continue_generation", {}, timeout_s)

    async def abort_request(self, rid: str = "", abort_all: bool = False, timeout_s: float | None = None) -> None:
        """Abort one request by id, or every request; answers an empty 200."""
        body: dict = {"rid": rid} if rid else {}
        if abort_all:
            body["abort_all"] = True
        status, text = await self._call("POST", "/abort_request", body, timeout_s)
        if status in (401, 403):
            raise self._refused("/abort_request", status, True)
        if status != 200:
            raise AdminError(self.url, "/abort_request", f"HTTP {status}: {_message(_parse(text), text)}", status)

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Drop the prefix cache; SGLang refuses (400) while requests are running."""
        status, text = await self._call("POST", "/flush_cache", None, timeout_s)
        if status in (401, 403):
            raise self._refused("/flush_cache", status, True)
        if status != 200:
            raise AdminError(self.url, "/flush_cache", f"HTTP {status}: {text.strip()[:300]}", status)

    # ---- weights (admin key) -------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                       *, abort_all_requests: bool = False, load_format: str | None = None,
                                       flush_cache: bool = True, timeout_s: float | None = None) -> dict:
        """Load a Hugging Face directory (no session needed); the reply has `num_paused_requests`.
        `flush_cache=False` keeps the running batch's KV cache (an `in_place` pause: SGLang
        refuses the flush, and so the update, while requests are running)."""
        body: dict = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not flush_cache:
            body["flush_cache"] = False
        if abort_all_requests:
            body["abort_all_requests"] = True
        if load_format:
            body["load_format"] = load_format
        return await self._success("/update_weights_from_disk", body, timeout_s)

    async def begin_weight_update(self, timeout_s: float | None = None) -> dict:
        """Open the weight-update session that distributed and tensor updates must run in
        (SGLang answers 400 to them outside one, and to a second begin before the end)."""
        return await self._success("/begin_weight_update", {}, timeout_s)

    async def end_weight_update(self, timeout_s: float | None = None) -> dict:
        """Close the session begin opened (finalises the loaded weights); 400 if none is open."""
        return await self._success("/end_weight_update", {}, timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: float | None = None) -> dict:
        """Join the trainer's broadcast group (each TP rank at rank_offset + tp_rank); returns
        once every member has joined."""
        return await self._success("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout_s)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | int | None = None, *,
                                              flush_cache: bool = True, abort_all_requests: bool = False,
                                              timeout_s: float | None = None) -> dict:
        """Receive every tensor of `names` (in order) broadcast from rank 0 of the group.
        Must run inside a weight-update session (`begin_weight_update`)."""
        body: dict = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                      "group_name": group_name}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not flush_cache:
            body["flush_cache"] = False
        if abort_all_requests:
            body["abort_all_requests"] = True
        return await self._success("/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                           timeout_s: float | None = None) -> dict:
        return await self._success("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False,
                                    timeout_s: float | None = None) -> dict:
        """Set the `weight_version` the server reports (and stamps tokens with) without loading
        anything: what follows a LoRA adapter swap, which leaves it alone. SGLang's default is to
        abort every request first; here that is asked for explicitly."""
        return await self._success("/update_weight_version", {"new_version": str(new_version),
                                                              "abort_all_requests": abort_all_requests}, timeout_s)

    # ---- LoRA adapters (admin key; the server runs with --enable-lora) ---------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False,
                                timeout_s: float | None = None) -> dict:
        """Load peft's adapter directory `lora_path` under `lora_name` (requests name it in
        `lora_path`); 400 with `error_message` if the name is taken or the adapter does not fit."""
        return await self._success("/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path),
                                                          "pinned": pinned}, timeout_s)

    async def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> dict:
        """Stop serving `lora_name`: new requests naming it are refused at once; the call returns
        once the requests that were using it have finished."""
        return await self._success("/unload_lora_adapter", {"lora_name": lora_name}, timeout_s)

    # ---- information (API key) -----------------------------------------------------------
    async def model_info(self, timeout_s: float | None = None) -> dict:
        """`/model_info`: answered by the HTTP process from its own state (no generation, no
        scheduler round trip, so it answers during a pause or a long update); its
        `weight_version` is the live one, moved by every update."""
        return await self._json("GET", "/model_info", None, timeout_s, admin=False)

    async def server_info(self, timeout_s: float | None = None) -> dict:
        """`/server_info`: the start-up arguments (`tp_size`, ...) plus scheduler state. Its
        top-level `weight_version` is the start-up value: read versions from `model_info`."""
        return await self._json("GET", "/server_info", None, timeout_s, admin=False)

    async def loads(self, timeout_s: float | None = None) -> dict:
        """`/v1/loads`: `{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}`."""
        return await self._json("GET", "/v1/loads", None, timeout_s, admin=False)


def server_load(loads: dict) -> int:
    """Requests running + waiting over every data-parallel rank of a `/v1/loads` reply."""
    total = 0
    for rank in loads.get("loads") or []:
        if isinstance(rank, dict):
            for key in ("num_running_reqs", "num_waiting_reqs"):
                v = rank.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    total += v
    return total


def _parse(text: str):
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return None


def _message(reply, text: str) -> str:
    if isinstance(reply, dict):
        for key in ("message", "error_message", "detail", "error"):
            if isinstance(reply.get(key), str):
                return reply[key][:500]
        err = reply.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:500]
    return text.strip()[:500] or "(empty reply)"
