"""An async client for the administrative endpoints of a generation server (SGLang 0.5.x API).

The controller drives weight updates through it; the same calls work against SGLang and the
embedded server. Request bodies carry only fields SGLang 0.5.x defines (its `io_struct.py`:
`PauseGenerationReqInput`, `UpdateWeightFromDiskReqInput`, `InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `DestroyWeightsUpdateGroupReqInput`), and only the
ones that differ from SGLang's defaults, so older and newer servers read them the same way.
Replies follow its `http_server.py`: weight calls answer `{"success", "message"}` with 200 or
400; pause/continue answer `{"message", "status"}`; `/flush_cache` answers text, 200 or 400;
`/health` answers an empty 200 or 503. Every failure raises `AdminError` naming the server,
the endpoint and what it said; nothing fails silently.
"""
from __future__ import annotations

import json
import logging

import aiohttp

log = logging.getLogger(__name__)


class AdminError(RuntimeError):
    """A generation server refused or failed an administrative call (or could not be reached)."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None):
        super().__init__(f"{url}{endpoint}: {message}")
        self.url, self.endpoint, self.status, self.detail = url, endpoint, status, message


class AdminClient:
    """One generation server's admin API. `timeout_s` bounds each call unless one is given."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 30.0,
                 session: aiohttp.ClientSession | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key or None
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
                    timeout_s: float | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._http().request(method, self.url + endpoint, json=body, headers=headers,
                                            timeout=timeout) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise AdminError(self.url, endpoint, f"{type(e).__name__}: {e}".rstrip(": ")) from None

    async def _json(self, method: str, endpoint: str, body: dict | None = None,
                    timeout_s: float | None = None) -> dict:
        status, text = await self._call(method, endpoint, body, timeout_s)
        try:
            reply = json.loads(text) if text.strip() else {}
        except ValueError:
            reply = None
        if status == 401:
            raise AdminError(self.url, endpoint, "unauthorized (wrong or missing API key)", status)
        if status != 200 or not isinstance(reply, dict):
            raise AdminError(self.url, endpoint, f"HTTP {status}: {_message(reply, text)}", status)
        return reply

    async def _update(self, endpoint: str, body: dict, timeout_s: float | None) -> dict:
        """Weight calls: success only if HTTP 200 and `success` is true."""
        status, text = await self._call("POST", endpoint, body, timeout_s)
        try:
            reply = json.loads(text)
        except ValueError:
            reply = None
        if status == 401:
            raise AdminError(self.url, endpoint, "unauthorized (wrong or missing API key)", status)
        if not isinstance(reply, dict) or status != 200 or reply.get("success") is not True:
            raise AdminError(self.url, endpoint, f"HTTP {status}: {_message(reply, text)}", status)
        return reply

    # ---- generation control -------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort", timeout_s: float | None = None) -> dict:
        """abort: in-flight requests return at once with what they have (finish_reason abort)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be abort, retract or in_place, got {mode!r}")
        return await self._json("POST", "/pause_generation", {"mode": mode}, timeout_s)

    async def continue_generation(self, timeout_s: float | None = None) -> dict:
        return await self._json("POST", "/continue_generation", {}, timeout_s)

    # ---- weights ------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                       *, abort_all_requests: bool = False, load_format: str | None = None,
                                       timeout_s: float | None = None) -> dict:
        """Load a Hugging Face directory; the reply has `num_paused_requests`."""
        body: dict = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if abort_all_requests:
            body["abort_all_requests"] = True
        if load_format:
            body["load_format"] = load_format
        return await self._update("/update_weights_from_disk", body, timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: float | None = None) -> dict:
        """Join the trainer's broadcast group; returns once every member has joined."""
        return await self._update("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout_s)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | int | None = None, *,
                                              flush_cache: bool = True, abort_all_requests: bool = False,
                                              timeout_s: float | None = None) -> dict:
        """Receive every tensor of `names` (in order) broadcast from rank 0 of the group."""
        body: dict = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                      "group_name": group_name}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not flush_cache:
            body["flush_cache"] = False
        if abort_all_requests:
            body["abort_all_requests"] = True
        return await self._update("/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                           timeout_s: float | None = None) -> dict:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Drop the prefix cache; SGLang refuses (400) while requests are running."""
        status, text = await self._call("POST", "/flush_cache", None, timeout_s)
        if status != 200:
            raise AdminError(self.url, "/flush_cache", f"HTTP {status}: {text.strip()[:300]}", status)

    # ---- information --------------------------------------------------------------------
    async def health(self, timeout_s: float | None = None) -> bool:
        """True when the server answers /health with 200; False on 503 or no answer."""
        try:
            status, _ = await self._call("GET", "/health", None, timeout_s)
        except AdminError:
            return False
        return status == 200

    async def get_server_info(self, timeout_s: float | None = None) -> dict:
        return await self._json("GET", "/get_server_info", None, timeout_s)

    async def get_model_info(self, timeout_s: float | None = None) -> dict:
        return await self._json("GET", "/get_model_info", None, timeout_s)


def server_load(info: dict) -> int:
    """Requests running + waiting, from a /get_server_info reply (0 when it does not say)."""
    total = 0
    for state in info.get("internal_states") or []:
        if isinstance(state, dict):
            for key in ("num_running_reqs", "num_waiting_reqs"):
                v = state.get(key)
                if isinstance(v, int) and not isinstance(v, bool):
                    total += v
    return total


def _message(reply, text: str) -> str:
    if isinstance(reply, dict):
        for key in ("message", "detail"):
            if isinstance(reply.get(key), str):
                return reply[key][:500]
        err = reply.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:500]
    return text.strip()[:500] or "(empty reply)"
