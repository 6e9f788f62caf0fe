"""The generation client: one sample, however many interruptions it takes.

Rollout workers call `GenerationClient.generate(prompt_ids, sampling_params, sticky_key)` and get
the whole completion back, with the behaviour log-prob and the policy version of every token,
against SGLang or the embedded server alike (only SGLang's documented `/generate` shape is used).

Interruptions: a weight update pauses the server in `abort` mode, so an in-flight request comes
back early with `finish_reason.type == "abort"` and the tokens it had, stamped with the version
that produced them. The client then resubmits prompt + tokens so far, with the remaining token
budget, to the same server; that request waits at the server until generation continues, and
its tokens carry the new version. So one sample may read `[v0 ... v0, v1 ... v1]`.

Failures: a connection error, a timeout or a 5xx moves the request to another server (the
tokens already received are kept); a 4xx is the caller's mistake and raises at once. Every
failure ends in `GenerationError`, never in a silently shortened sample.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)
DEFAULT_MAX_NEW_TOKENS = 128    # SGLang's default when sampling_params has none


class GenerationError(RuntimeError):
    """The sample could not be completed; the message says why and where."""


@dataclass(frozen=True)
class ServerRef:
    url: str
    api_key: str | None = None


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    # log_softmax(logits / T) of each sampled token (docs/generation.md)
    output_logprobs: list[float] = field(default_factory=list)
    # weight version of the policy that produced each token
    output_versions: list[int] = field(default_factory=list)
    # "stop" or "length"
    finish_reason: str = ""
    # /generate calls made, interruptions (abort replies) survived, server failures survived
    requests: int = 0
    interruptions: int = 0
    failovers: int = 0
    server: str = ""


Picker = Callable[[str, frozenset], "ServerRef | str | Awaitable[ServerRef | str]"]


def parse_version(value) -> int:
    """SGLang's weight_version is a string; Tandem sets it to the integer policy version.
    SGLang's own default, "default", means the weights it started with: version 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value in (None, "default"):
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise GenerationError(f"server weight_version {value!r} is not an integer policy version") from None


class GenerationClient:
    """`servers`: a list of URLs / `ServerRef`s (chosen by a hash of the sticky key, failing over
    in order), or a picker `(sticky_key, excluded_urls) -> ServerRef | url` (sync or async)."""

    def __init__(self, servers: Sequence[ServerRef | str] | Picker, *, api_key: str | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0, max_failovers: int = 3,
                 max_interruptions: int = 64, retry_delay_s: float = 0.5):
        self._picker = servers if callable(servers) else None
        self._servers = [] if callable(servers) else [_ref(s, api_key) for s in servers]
        if self._picker is None and not self._servers:
            raise ValueError("GenerationClient: give at least one server or a picker")
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.max_failovers, self.max_interruptions = max_failovers, max_interruptions
        self.retry_delay_s = retry_delay_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def pick(self, sticky_key: str, exclude: frozenset) -> ServerRef:
        if self._picker is not None:
            choice = self._picker(sticky_key, exclude)
            if inspect.isawaitable(choice):
                choice = await choice
            return _ref(choice, self.api_key)
        live = [s for s in self._servers if s.url not in exclude] or self._servers
        return live[zlib.crc32(sticky_key.encode()) % len(live)]

    async def generate(self, prompt_ids: Sequence[int], sampling_params: dict | None = None,
                       sticky_key: str = "") -> GenerationResult:
        params = dict(sampling_params or {})
        budget = int(params.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
        seed = params.get("sampling_seed")
        res = GenerationResult(prompt_ids=list(prompt_ids))
        failed: set[str] = set()
        server = await self.pick(sticky_key, frozenset())
        while True:
            remaining = budget - len(res.output_ids)
            params["max_new_tokens"] = remaining
            if seed is not None:      # a resumed segment must not replay the first segment's draws
                params["sampling_seed"] = int(seed) + len(res.output_ids)
            rid = uuid.uuid4().hex
            payload = {"input_ids": res.prompt_ids + res.output_ids, "sampling_params": params,
                       "return_logprob": True, "rid": rid}
            res.requests += 1
            try:
                reply = await self._post(server, payload)
            except _ServerDown as e:
                await self._abort_quietly(server, rid)
                res.failovers += 1
                failed.add(server.url)
                if res.failovers > self.max_failovers:
                    raise GenerationError(f"generation failed on {res.failovers} servers; last: {e}") from None
                log.warning("%s; retrying on another server", e)
                await asyncio.sleep(self.retry_delay_s)
                server = await self.pick(sticky_key, frozenset(failed))
                continue
            reason = self._absorb(res, reply, server)
            res.server = server.url
            if reason in ("stop", "length"):
                res.finish_reason = reason
                return res
            if len(res.output_ids) >= budget:
                res.finish_reason = "length"
                return res
            res.interruptions += 1
            if res.interruptions > self.max_interruptions:
                raise GenerationError(f"{server.url}: aborted {res.interruptions} times in a row "
                                      f"({len(res.output_ids)}/{budget} tokens); giving up")

    def _absorb(self, res: GenerationResult, reply, server: ServerRef) -> str:
        """Append one reply's tokens; return its finish type ("stop", "length" or "abort")."""
        try:
            meta = reply["meta_info"]
            ids = list(reply["output_ids"])
            pairs = meta["output_token_logprobs"] or []
            reason = meta["finish_reason"]["type"]
            version = parse_version(meta.get("weight_version"))
        except (KeyError, TypeError) as e:
            raise GenerationError(f"{server.url}: malformed /generate reply (missing {e})") from None
        if [int(p[1]) for p in pairs] != ids:
            raise GenerationError(f"{server.url}: output_token_logprobs do not match output_ids")
        if reason not in ("stop", "length", "abort"):
            raise GenerationError(f"{server.url}: unknown finish_reason {meta['finish_reason']!r}")
        res.output_ids += ids
        res.output_logprobs += [float(p[0]) for p in pairs]
        res.output_versions += [version] * len(ids)
        return reason

    async def _abort_quietly(self, server: ServerRef, rid: str) -> None:
        """A timed-out request may still be running there: stop it (best effort, short timeout)."""
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        timeout = aiohttp.ClientTimeout(total=min(2.0, self.timeout.total or 2.0))
        try:
            async with self._http().post(server.url.rstrip("/") + "/abort_request", json={"rid": rid},
                                         headers=headers, timeout=timeout):
                pass
        except (aiohttp.ClientError, TimeoutError):
            pass

    async def _post(self, server: ServerRef, payload: dict):
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        url = server.url.rstrip("/") + "/generate"
        try:
            async with self._http().post(url, json=payload, headers=headers, timeout=self.timeout) as resp:
                if resp.status >= 500:
                    raise _ServerDown(f"{url}: HTTP {resp.status} {(await resp.text())[:200]}")
                if resp.status != 200:
                    raise GenerationError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            raise _ServerDown(f"{url}: {type(e).__name__} {e}") from None


class _ServerDown(Exception):
    """The server could not answer (connection, timeout, 5xx): try another one."""


def _ref(s: ServerRef | str, api_key: str | None) -> ServerRef:
    return s if isinstance(s, ServerRef) else ServerRef(str(s), api_key)
