"""The generation client: one sample, however many interruptions it takes.

Rollout workers call `GenerationClient.generate(prompt_ids, sampling_params, sticky_key)` and get
the whole completion back, with the behaviour log-prob and the policy version of every token,
against SGLang or the embedded server alike (only SGLang's documented `/generate` shape is used).

Versions: every token is stamped with the weight version that produced it, read from the
reply's `meta_info.weight_versions` spans (`[{version, start, end}]`, SGLang 0.5.23) when the
server sends them — checked to cover exactly the reply's output tokens — else from the reply's
`weight_version` (older servers).

Interruptions, three ways, all exact:
- `abort` pause (the controller's `abort` mode): an in-flight request comes back early with
  `finish_reason.type == "abort"` and the tokens it had. The client resubmits prompt + tokens so
  far, with the remaining budget, to the same server (with a picker, the server the picker names
  for the sticky key: the same one unless it left the rotation, e.g. retired by the elastic
  split); that request waits there until generation continues. One sample then reads
  `[v0 ... v0, v1 ... v1]` over several requests.
- `retract` pause: the server keeps the request across the update (its KV cache dropped and
  recomputed under the new weights) and answers once, with spans over two or more versions.
  Nothing is resubmitted.
- `in_place` pause (the controller's default): as `retract`, but the request keeps its KV cache
  of the old weights; the client sees the same single reply with spans.

Chunks (`chunk_tokens`, `rollout.new_tokens_per_chunk`; AReaL's `new_tokens_per_chunk`): each
request asks for at most that many new tokens, and the client resubmits prompt + tokens so far
until the answer stops or its budget is spent, exactly as after an abort. Its use: with
`controller.interruptible: false` a weight update waits for the requests running on a server
to finish (SGLang's drain), so chunks bound that wait to one chunk instead of a whole answer, and
the tokens after the update are the new policy's. Each resubmission prefills prompt + output
again: SGLang's radix cache mostly keeps that prefix; the embedded server recomputes it.

Seeds: `sampling_seed` only does something where the server honours it. On SGLang 0.5.23 that
is only with `--enable-deterministic-inference` (the sampler reads per-request seeds only then,
`sampling/sampling_batch_info.py`; the draw is keyed by seed and position, so a resumed segment
keeps the same seed); the embedded server always honours it with one random stream per request
(so a resumed segment must use a fresh seed: `seed + tokens so far`). `seed_mode="auto"` asks
each server's `/server_info` once, the first time a seeded request goes there, and sends no seed
where it would do nothing (`GenerationResult.seeded` says whether the seed took effect).

Routed experts (rollout routing replay, MoE models; `routed_experts=(layers, top_k)`): every
request asks for SGLang's `return_routed_experts` from `routed_experts_start_len` = the positions
already covered (0 at first: the prompt's routing is kept too, since every later token attends to
it), so the segments of an interrupted or chunked sample join exactly: position p's experts come
from the request that first fed token p to the model. `GenerationResult.routed_experts` is then
int32 [prompt + output - 1, layers, top_k] (the last token was never fed). A reply without them
(SGLang without `--enable-return-routed-experts`, a dense model) raises `GenerationError`.

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
import numpy as np

log = logging.getLogger(__name__)
DEFAULT_MAX_NEW_TOKENS = 128    # SGLang's default when sampling_params has none
# How a server treats sampling_seed: "stream" (one random stream per request: the embedded
# server), "position" (draws keyed by seed and position: SGLang with deterministic inference),
# "ignored" (SGLang without it), or "auto" (ask the server's /server_info).
SEED_MODES = ("auto", "stream", "position", "ignored")


class GenerationError(RuntimeError):
    """The sample could not be completed; the message says why and where."""


@dataclass(frozen=True)
class ServerRef:
    """A server's address and keys. The admin key (SGLang's `--admin-api-key`) is only used for a
    best-effort `/abort_request` after a timeout; without it the API key is tried (enough on a
    server without an admin key; on one with it, the abort is refused and the request runs on)."""
    url: str
    api_key: str | None = None
    admin_api_key: str | None = None


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
    # /generate calls made (chunks and resumptions included), interruptions (abort replies)
    # survived, server failures survived
    requests: int = 0
    interruptions: int = 0
    failovers: int = 0
    server: str = ""
    # whether a requested sampling_seed took effect on every server that generated this sample
    seeded: bool = False
    # with routed_experts on: each reply's int32 [positions, layers, top_k], in position order
    routed_chunks: list = field(default_factory=list)
    routed_len: int = 0

    @property
    def routed_experts(self) -> np.ndarray | None:
        """int32 [prompt + output - 1, layers, top_k]: the experts of every position fed to the
        model, or None when they were not asked for."""
        return np.concatenate(self.routed_chunks, 0) if self.routed_chunks else None


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
    in order), or a picker `(sticky_key, excluded_urls) -> ServerRef | url` (sync or async).
    `seed_mode`: how servers treat `sampling_seed` (`SEED_MODES`; "auto" asks each server once).
    Failovers wait `retry_delay_s`, doubling after each one up to `MAX_RETRY_DELAY_S`: another
    live server is tried at once, and a restarting one (the only server, killed and started
    again at its address) gets time to come back — about 20 s with the defaults — before the
    request fails and its group is retried (a prompt has three tries, rollout.max_attempts)."""
    MAX_RETRY_DELAY_S = 4.0

    def __init__(self, servers: Sequence[ServerRef | str] | Picker, *, api_key: str | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0, max_failovers: int = 7,
                 max_interruptions: int = 64, retry_delay_s: float = 0.5, seed_mode: str = "auto",
                 adapter: str | None = None, chunk_tokens: int = 0,
                 routed_experts: tuple[int, int] | None = None):
        if seed_mode not in SEED_MODES:
            raise ValueError(f"GenerationClient: seed_mode must be one of {SEED_MODES}, got {seed_mode!r}")
        self.seed_mode = seed_mode
        # The LoRA adapter every request names (SGLang's `lora_path`), resubmissions included:
        # the servers swap what the name holds at each update (services/controller/weights/adapter.py).
        self.adapter = adapter
        if chunk_tokens < 0:
            raise ValueError(f"GenerationClient: chunk_tokens must be >= 0 (0: no chunks), got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        # (layers, top_k) of the served MoE model: ask for the routed experts (module docstring)
        self.routed_experts = routed_experts
        self._seed_modes: dict[str, str] = {}
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
        seed = params.pop("sampling_seed", None)
        res = GenerationResult(prompt_ids=list(prompt_ids), seeded=seed is not None)
        failed: set[str] = set()
        stalled = 0   # aborts in a row without a new token
        server = await self.pick(sticky_key, frozenset())
        while True:
            remaining = budget - len(res.output_ids)
            asked = min(remaining, self.chunk_tokens) if self.chunk_tokens else remaining
            params["max_new_tokens"] = asked
            params.pop("sampling_seed", None)
            if seed is not None:
                mode = await self._seed_mode_of(server)
                if mode == "stream":      # a resumed segment must not replay the first one's draws
                    params["sampling_seed"] = int(seed) + len(res.output_ids)
                elif mode == "position":  # draws are keyed by position already
                    params["sampling_seed"] = int(seed)
                else:
                    res.seeded = False
            rid = uuid.uuid4().hex
            payload = {"input_ids": res.prompt_ids + res.output_ids, "sampling_params": params,
                       "return_logprob": True, "rid": rid}
            if self.adapter:
                payload["lora_path"] = self.adapter
            if self.routed_experts:
                payload["return_routed_experts"] = True
                payload["routed_experts_start_len"] = res.routed_len
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
                await asyncio.sleep(min(self.retry_delay_s * 2 ** (res.failovers - 1), self.MAX_RETRY_DELAY_S))
                server = await self.pick(sticky_key, frozenset(failed))
                continue
            before = len(res.output_ids)
            if self.routed_experts:
                self._absorb_routing(res, reply, server, fed=len(payload["input_ids"]))
            reason = self._absorb(res, reply, server)
            res.server = server.url
            if reason == "length" and asked < remaining and len(res.output_ids) - before == asked:
                continue        # a chunk ended, not the answer: the next chunk
            if reason in ("stop", "length"):
                res.finish_reason = reason
                return res
            if len(res.output_ids) >= budget:
                res.finish_reason = "length"
                return res
            res.interruptions += 1
            # Only aborts that bring nothing count against the limit: one with new tokens is an
            # update landing mid-answer, and the token budget bounds how often that can happen.
            stalled = 0 if len(res.output_ids) > before else stalled + 1
            if stalled > self.max_interruptions:
                raise GenerationError(f"{server.url}: aborted {stalled} times in a row without a new token "
                                      f"({len(res.output_ids)}/{budget} tokens); giving up")
            if self._picker is not None:
                # Where the rest goes is the router's call: the sticky key keeps it on this server
                # (a weight update's pause), unless the server left the rotation meanwhile (retired
                # by the elastic split, failed an update), when it goes on elsewhere.
                server = await self.pick(sticky_key, frozenset(failed))

    def _absorb(self, res: GenerationResult, reply, server: ServerRef) -> str:
        """Append one reply's tokens; return its finish type ("stop", "length" or "abort")."""
        try:
            meta = reply["meta_info"]
            ids = list(reply["output_ids"])
            pairs = meta["output_token_logprobs"] or []
            reason = meta["finish_reason"]["type"]
            versions = token_versions(meta, len(ids))
        except (KeyError, TypeError) as e:
            raise GenerationError(f"{server.url}: malformed /generate reply (missing {e})") from None
        except ValueError as e:
            raise GenerationError(f"{server.url}: {e}") from None
        if [int(p[1]) for p in pairs] != ids:
            raise GenerationError(f"{server.url}: output_token_logprobs do not match output_ids")
        if reason not in ("stop", "length", "abort"):
            raise GenerationError(f"{server.url}: unknown finish_reason {meta['finish_reason']!r}")
        res.output_ids += ids
        res.output_logprobs += [float(p[0]) for p in pairs]
        res.output_versions += versions
        return reason

    def _absorb_routing(self, res: GenerationResult, reply, server: ServerRef, fed: int) -> None:
        """Keep one reply's routed experts: positions [res.routed_len, fed + new tokens - 1)."""
        try:
            meta, new = reply["meta_info"], len(reply["output_ids"])
        except (KeyError, TypeError) as e:
            raise GenerationError(f"{server.url}: malformed /generate reply (missing {e})") from None
        if new == 0:     # nothing generated (an abort before it ran): nothing new was fed either
            return
        if "routed_experts" not in meta:
            raise GenerationError(f"{server.url}: the reply has no routed_experts, which routing replay needs: "
                                  f"SGLang returns them only when launched with --enable-return-routed-experts, "
                                  f"and only for a mixture-of-experts model")
        layers, top_k = self.routed_experts
        try:
            rows = decode_routed_experts(meta["routed_experts"], layers, top_k)
        except ValueError as e:
            raise GenerationError(f"{server.url}: {e}") from None
        want = fed + new - 1 - res.routed_len
        if len(rows) != want:
            raise GenerationError(f"{server.url}: routed_experts has {len(rows)} positions, expected {want} "
                                  f"(from {res.routed_len} to the {fed + new - 1} fed)")
        res.routed_chunks.append(rows)
        res.routed_len += len(rows)

    async def _seed_mode_of(self, server: ServerRef) -> str:
        """How `server` treats sampling_seed (asked once per server in "auto" mode)."""
        if self.seed_mode != "auto":
            return self.seed_mode
        if server.url not in self._seed_modes:
            headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            try:
                async with self._http().get(server.url.rstrip("/") + "/server_info", headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    info = await resp.json(content_type=None) if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                info = None
            if not isinstance(info, dict):
                log.warning("%s: /server_info unavailable; not relying on sampling_seed there", server.url)
                return "ignored"
            mode = seed_mode_from_server_info(info)
            if mode == "ignored":
                log.warning("%s: sampling_seed does nothing on this server (SGLang without "
                            "--enable-deterministic-inference); sampling there is not reproducible", server.url)
            self._seed_modes[server.url] = mode
        return self._seed_modes[server.url]

    async def _abort_quietly(self, server: ServerRef, rid: str) -> None:
        """A timed-out request may still be running there: stop it (best effort, short timeout)."""
        key = server.admin_api_key or server.api_key     # /abort_request is an admin route
        headers = {"Authorization": f"Bearer {key}"} if key else {}
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


def token_versions(meta: dict, num_tokens: int) -> list[int]:
    """The policy version of each output token of one reply. From `weight_versions` spans when
    present (they must cover exactly the output tokens, in order, and end with `weight_version`);
    else every token gets the reply's `weight_version`. ValueError names what is wrong."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [parse_version(meta.get("weight_version"))] * num_tokens
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"weight_versions must be a non-empty list of spans, got {spans!r:.200}")
    out: list[int] = []
    for i, span in enumerate(spans):
        if not isinstance(span, dict) or not {"version", "start", "end"} <= set(span):
            raise ValueError(f"weight_versions[{i}] is not a {{version, start, end}} span: {span!r:.200}")
        start, end = span["start"], span["end"]
        if not (isinstance(start, int) and isinstance(end, int)) or start != len(out) or end < start:
            raise ValueError(f"weight_versions[{i}] = {span} does not continue the spans before it "
                             f"(expected start {len(out)}, end >= start)")
        out += [parse_version(span["version"])] * (end - start)
    if len(out) != num_tokens:
        raise ValueError(f"weight_versions cover {len(out)} tokens but the reply has {num_tokens} output tokens")
    last = spans[-1]["version"]
    if "weight_version" in meta and meta["weight_version"] != last:
        raise ValueError(f"weight_version {meta['weight_version']!r} differs from the last span's {last!r}")
    return out


def decode_routed_experts(text: str, layers: int, top_k: int) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of little-endian int32) -> [positions, layers,
    top_k]; ValueError when it is not that."""
    import base64
    import binascii
    try:
        raw = base64.b64decode(text or "", validate=True)
    except (binascii.Error, TypeError) as e:
        raise ValueError(f"routed_experts is not base64 ({e})") from None
    if len(raw) % (4 * layers * top_k):
        raise ValueError(f"routed_experts: {len(raw)} bytes do not fill int32 rows of {layers} layers x {top_k}")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k).astype(np.int32)


def seed_mode_from_server_info(info: dict) -> str:
    """"stream" for the embedded server, "position" for SGLang with deterministic inference,
    "ignored" for SGLang without it (sampling_batch_info.py builds no seeds then)."""
    if str(info.get("version", "")).startswith("tandem-embedded"):
        return "stream"
    return "position" if info.get("enable_deterministic_inference") else "ignored"


def _ref(s: ServerRef | str, api_key: str | None) -> ServerRef:
    return s if isinstance(s, ServerRef) else ServerRef(str(s), api_key)
