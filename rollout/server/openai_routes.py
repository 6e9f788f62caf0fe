"""`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`: the OpenAI API on the
embedded server, as SGLang 0.5.23 serves it (`entrypoints/http_server.py`, `entrypoints/openai/`).

Why here and not in a separate process: an OpenAI request must be served by the same engine as
`/generate` — batched with rollouts, held by a pause, aborted by `/abort_request` or
`/pause_generation`, answered by whatever weights the last update loaded (`metadata.weight_version`
says which). So the routes only translate: `openai_requests` turns a body into engine requests,
the engine generates, `openai_shapes` writes the reply. Streaming (`stream: true`) sends
Server-Sent Events, `data: {json}\\n\\n` per chunk and `data: [DONE]\\n\\n` last; the engine hands
over each token as it is sampled (`Request.on_token`), and the text sent never contains a piece
that a stop string could still cut (see `StreamedText`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from . import openai_shapes as shapes
from .engine import Request
from .openai_requests import CHAT, COMPLETIONS, Job, OpenAIBadRequest, parse_chat, parse_completion
from .requests import read_json
from .sampling import BadRequest

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
# generation_config.json keys the release's chat route takes as defaults (`get_default_sampling_params`);
# the embedded sampler has no min_p or repetition penalty, so only these three are applied.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k")


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class StreamedText:
    """One sample's text as it streams: the part that is safe to send now.

    Held back until the sample finishes: a trailing incomplete UTF-8 character (up to three
    replacement characters: its bytes so far), the text of a
    last token that ends generation (EOS, a stop token id: the reply trims it), and a tail that
    a stop string could still complete (its first characters). So the chunks always join to the
    final text exactly. (SGLang's detokenizer sends such a tail and cannot take it back.)
    """

    def __init__(self, tokenizer, params, stop_ids: set[int]):
        self.tokenizer, self.params = tokenizer, params
        self.stop_ids = set() if params.no_stop_trim else stop_ids | set(params.stop_token_ids)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0           # characters sent
        self.sent_tokens = 0    # tokens whose ids / log-probs were sent
        self.result: dict | None = None

    def delta(self) -> str:
        if self.result is not None:
            text = self.result["text"]
        else:
            ids = self.ids[:-1] if self.ids and self.ids[-1] in self.stop_ids else self.ids
            text = self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
            tail = len(text) - len(text.rstrip("\ufffd"))     # an unfinished character: <= 3 bytes
            text = text[:len(text) - min(tail, 3)]
            hit = min((p for p in (text.find(s) for s in self.params.stop) if p >= 0), default=-1)
            if hit >= 0:    # the engine finishes on it: the reply's text ends here (or after it)
                text = text[:hit]
            text = text[:len(text) - self._stop_prefix(text)]
        out = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return out

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((k for s in self.params.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def new_tokens(self) -> tuple[list[int], list[float]]:
        ids, lps = self.ids[self.sent_tokens:], self.logprobs[self.sent_tokens:]
        self.sent_tokens = len(self.ids)
        return ids, lps


class OpenAIRoutes:
    """Mixed into `GenServer` (which owns `engine`, `server_args`, `open` and `_run`)."""

    def _served_name(self) -> str:
        return self.server_args.get("served_model_name", self.server_args["model_path"])

    def _generation_defaults(self) -> dict:
        """The model's generation_config.json sampling values (none when it has no such file)."""
        if getattr(self, "_gen_defaults", None) is None:
            cfg = {}
            if (Path(self.engine.model_path) / "generation_config.json").is_file():   # never the Hub
                try:
                    from transformers import GenerationConfig
                    cfg = GenerationConfig.from_pretrained(self.engine.model_path).to_dict()
                except Exception as e:   # unreadable: the OpenAI defaults
                    log.warning("generation_config.json of %s unreadable (%s): OpenAI defaults", self.engine.model_path, e)
            self._gen_defaults = {k: cfg[k] for k in GENERATION_DEFAULTS if cfg.get(k) is not None}
            ignored = {k: cfg[k] for k in ("min_p", "repetition_penalty") if cfg.get(k) not in (None, 0, 0.0, 1, 1.0)}
            if ignored:
                log.warning("generation_config.json sets %s: not applied by the embedded sampler", ignored)
        return self._gen_defaults

    # ---- routes -------------------------------------------------------------------------------
    async def models(self, request):
        return web.json_response(shapes.model_list(self._served_name(), self.engine.context_len, int(time.time())))

    async def completions(self, request):
        return await self._openai(request, COMPLETIONS)

    async def chat_completions(self, request):
        return await self._openai(request, CHAT)

    async def _openai(self, request, route: str):
        try:
            if request.content_type != "application/json":    # http_server.py validate_json_request
                raise OpenAIBadRequest("Unsupported Media Type: Only 'application/json' is allowed", None,
                                       "Bad Request")
            body = await read_json(request)
            e = self.engine
            kw = {"tokenizer": e.tokenizer, "vocab": e.vocab_size, "context_len": e.context_len,
                  "served_name": self._served_name()}
            if route == CHAT:
                job = await asyncio.to_thread(parse_chat, body, defaults=self._generation_defaults(), **kw)
            else:
                job = await asyncio.to_thread(parse_completion, body, **kw)
            if job.stream:
                return await self._stream(request, job)
            return await self._complete(job)
        except BadRequest as e:
            log.info("400 %s: %s", route, e)
            return web.json_response(shapes.error_response(str(e), 400, getattr(e, "err_type", "BadRequestError"),
                                                           getattr(e, "param", None)), status=400)

    def _requests(self, job: Job, on_done, on_token=None) -> list[Request]:
        """Prompt-major: sample j of prompt i is request i * n + j (choice index likewise)."""
        reqs = []
        for i, prompt in enumerate(job.prompts):
            for j in range(job.n):
                k = i * job.n + j
                r = Request(prompt_ids=list(prompt), params=job.sample_params(j), on_done=on_done(k),
                            return_logprob=job.logprobs, return_text_in_logprobs=True,
                            on_token=on_token(k) if on_token else None)
                reqs.append(r)
        rids = job.rid
        if isinstance(rids, str):
            rids = [rids] if len(reqs) == 1 else [f"{rids}_{k}" for k in range(len(reqs))]
        if rids is not None:
            if len(rids) != len(reqs):
                raise OpenAIBadRequest(f"{job.route}: `rid` must have one entry per sample ({len(reqs)}), "
                                       f"got {len(rids)}", "rid")
            for r, rid in zip(reqs, rids, strict=True):
                r.rid = rid
        return reqs

    async def _complete(self, job: Job):
        loop = asyncio.get_running_loop()
        futures = []

        def on_done(k):
            fut = loop.create_future()
            futures.append(fut)
            return lambda resp: loop.call_soon_threadsafe(_resolve, fut, resp)

        results = await self._run(self._requests(job, on_done), futures)
        failed = next((r for r in results if _internal_error(r)), None)
        if failed is not None:
            message = failed["meta_info"]["finish_reason"]["message"]
            return web.json_response(shapes.error_response(f"Internal server error: {message}", 500,
                                                           "InternalServerError"), status=500)
        build = shapes.chat_response if job.route == CHAT else shapes.completion_response
        return web.json_response(build(job, results, int(time.time())))

    async def _stream(self, request, job: Job):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop_ids = self.engine.eos_ids

        def on_done(k):
            return lambda resp: loop.call_soon_threadsafe(queue.put_nowait, (k, None, resp))

        def on_token(k):
            return lambda token, lp: loop.call_soon_threadsafe(queue.put_nowait, (k, token, lp))

        reqs = self._requests(job, on_done, on_token)
        texts = [StreamedText(self.engine.tokenizer, r.params, set() if r.params.ignore_eos else stop_ids)
                 for r in reqs]
        await self.open.wait()
        try:
            await asyncio.wrap_future(self.engine.submit(reqs))
        except ValueError as e:
            raise OpenAIBadRequest(str(e)) from None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            writer = _ChunkWriter(job, reqs[0].rid, int(time.time()), resp, self.engine.tokenizer)
            if await self._pump(queue, texts, writer):
                await writer.close(texts)
            else:   # an internal error: the rest of the reply is dropped, as the release does
                for r, t in zip(reqs, texts, strict=True):
                    if t.result is None:
                        self.engine.abort(rid=r.rid, message="stream ended by an internal error")
                await resp.write(DONE)
                await resp.write_eof()
        except ConnectionResetError:      # the client went away: stop spending compute on it
            self._abort_all(reqs)
        except asyncio.CancelledError:
            self._abort_all(reqs)
            raise
        return resp

    def _abort_all(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.engine.abort(rid=r.rid, message="client disconnected")

    async def _pump(self, queue: asyncio.Queue, texts: list[StreamedText], writer: _ChunkWriter) -> bool:
        """Until every sample finished: take what the engine produced (coalescing whatever has
        queued up into one chunk per sample), write the chunks. False on an internal error."""
        left = len(texts)
        while left:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            touched: dict[int, None] = {}
            for k, token, payload in events:
                if token is None:
                    texts[k].result = payload
                    left -= 1
                else:
                    texts[k].ids.append(token)
                    texts[k].logprobs.append(payload)
                touched[k] = None
            for k in touched:
                if not await writer.sample(k, texts[k]):
                    return False
        return True


class _ChunkWriter:
    """The chunk sequence of one streamed reply, in the release's order: per sample a first chunk
    (chat: `role: assistant`, empty content), then text deltas (completions: the last one with
    `finish_reason`); chat then sends a `finish_reason` chunk per sample once all are done; then
    the usage chunk (`stream_options.include_usage`), then `[DONE]`."""

    def __init__(self, job: Job, rid: str, created: int, resp: web.StreamResponse, tokenizer):
        self.job, self.rid, self.created, self.resp, self.tokenizer = job, rid, created, resp, tokenizer
        self.started: set[int] = set()
        self.finished: list[int] = []

    def _usage(self, k: int, t: StreamedText) -> dict | None:
        if not self.job.continuous_usage:
            return None
        return shapes.usage(len(self.job.prompts[k // self.job.n]), len(t.ids))

    async def sample(self, k: int, t: StreamedText) -> bool:
        """Write what sample k has new; False when it ended in an internal error (an error chunk
        was written: the stream stops, as the release's does on an abort carrying a status code)."""
        job, chat = self.job, self.job.route == CHAT
        if t.result is not None and _internal_error(t.result):
            message = t.result["meta_info"]["finish_reason"]["message"]
            err = shapes.error_response(f"Internal server error: {message}", 500, "InternalServerError")
            await self.resp.write(sse({"error": err}))
            return False
        first = k not in self.started
        self.started.add(k)
        delta = t.delta()
        ids, lps = t.new_tokens()
        reason, matched = shapes.finish(t.result["meta_info"]) if t.result is not None else (None, None)
        logprobs = None
        if job.logprobs and ids:
            triples = [[lp, tok, self._token_text(tok)] for tok, lp in zip(ids, lps, strict=True)]
            logprobs = shapes.chat_logprobs(triples) if chat else shapes.completion_logprobs(triples)
        if chat:
            if first:
                await self.resp.write(sse(shapes.chat_chunk(self.rid, self.created, job.model, k,
                                                            role="assistant", content="")))
            if delta or logprobs:
                await self.resp.write(sse(shapes.chat_chunk(self.rid, self.created, job.model, k, content=delta,
                                                            logprobs=logprobs, usage=self._usage(k, t))))
            if reason is not None:
                self.finished.append(k)
        elif delta or logprobs or reason is not None:
            await self.resp.write(sse(shapes.completion_chunk(
                self.rid, self.created, job.model, k, delta, finish_reason=reason, matched_stop=matched,
                logprobs=logprobs, usage=self._usage(k, t), token_ids=ids if job.return_token_ids else None,
                prompt_token_ids=job.prompts[k // job.n] if job.return_token_ids and first else None)))
        return True

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def close(self, texts: list[StreamedText]) -> None:
        job = self.job
        if job.route == CHAT:
            for k in self.finished:
                reason, matched = shapes.finish(texts[k].result["meta_info"])
                await self.resp.write(sse(shapes.chat_chunk(self.rid, self.created, job.model, k,
                                                            finish_reason=reason, matched_stop=matched)))
        if job.include_usage and all(t.result is not None for t in texts):
            totals = shapes.total_usage([t.result for t in texts], job.n)
            await self.resp.write(sse(shapes.usage_chunk(job, self.rid, self.created, totals)))
        await self.resp.write(DONE)
        await self.resp.write_eof()


def _internal_error(result: dict) -> bool:
    reason = result["meta_info"].get("finish_reason") or {}
    return reason.get("type") == "abort" and str(reason.get("message", "")).startswith("internal error")


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
