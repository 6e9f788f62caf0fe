"""The generation engine: one thread doing continuous batching over a transformers model.

Every step the engine admits waiting requests (one prefill each, under a token budget, so a long
prompt does not stall the batch for long), then runs one decode step for all running rows
together. A row that finishes leaves at once and its response is delivered; nobody waits for the
longest request. All state changes (submit, abort, pause, weight update) are commands executed on
this thread between steps, so the model and the KV cache are only ever touched by one thread.

A weight update runs only when nothing is generating under the old weights: the HTTP layer stops
new submissions, the engine finishes (or, when paused, holds) what it has, then swaps the weights,
records the version change on every held request (its `weight_versions` spans) and drops the KV
cache built with the old weights; held requests are re-prefilled under the new weights when they
resume. The one exception is SGLang's: an `in_place` pause keeps its running batch and that
batch's KV cache through an update (see `apply_update`).

Devices: the engine runs wherever the model's parameters are (`self.device`: cpu, or one CUDA
GPU, gen.device). Every tensor it feeds the model (input ids, positions, masks, KV rows) is made
there, because a CPU tensor beside CUDA weights fails at the first matmul of a GPU run (and
nowhere on a CPU-only machine: tests/unit/generation/test_engine_device.py checks it on the
CPU). What leaves the engine (token ids, log-probs) is python ints and floats.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .kv_batch import KVBatch
from .kv_rows import with_cache
from .routed_experts import RoutingCapture, encode
from .sampling import SamplingParams, logprob_temperature, sample_rows
from .versions import VersionChange, add_to_meta, spans
from .window import GenWindow

# Waiting requests looked at for samples sharing an admitted request's prompt (see _same_prompt).
SAME_PROMPT_SCAN = 1024

log = logging.getLogger(__name__)


@dataclass(eq=False)   # identity, not field, comparison
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[dict], None]      # called on the engine thread with the response dict
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list | None = None
    finish: dict | None = None
    matched_stop: str | None = None
    t_submit: float = field(default_factory=time.time)
    generator: torch.Generator | None = None
    pending: int | None = None           # last sampled token, not yet in the KV cache
    # weight version changes while this request was held (-> meta_info.weight_versions)
    version_changes: list[VersionChange] = field(default_factory=list)
    # Streaming (the OpenAI-compatible routes): called on the engine thread with each sampled
    # token and its log-prob, before the finish check, so every token precedes `on_done`.
    on_token: Callable[[int, float], None] | None = None
    # SGLang's return_routed_experts / routed_experts_start_len (MoE models, routed_experts.py):
    # the routing of every position fed so far, in chunks [n, layers, k] (position order).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed: list = field(default_factory=list)
    routed_len: int = 0


class Engine:
    def __init__(self, model, tokenizer, *, model_path: str, max_running: int = 64,
                 prefill_tokens_per_step: int = 2048, weight_version: str = "0", seed: int = 0,
                 metrics=None, metrics_interval_s: float = 5.0):
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.max_running, self.prefill_budget = max_running, prefill_tokens_per_step
        self.weight_version = weight_version
        self.context_len = int(getattr(model.config, "max_position_embeddings", 4096))
        self.vocab_size = int(model.config.vocab_size)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self.routing = RoutingCapture(model)     # no hooks on a dense model
        self.kv = KVBatch()
        self.running: list[Request] = []       # in KV-row order
        self._admitting: list[Request] = []    # taken from waiting by _admit, not yet running
        self.waiting: deque[Request] = deque()
        self.paused: str | None = None         # None, "abort", "retract" or "in_place"
        self._pending_idle: tuple[Callable[[], object], Future] | None = None
        self._throughput = (time.perf_counter(), 0, 0.0)   # (mark time, tokens at mark, tokens/s)
        # When the engine last produced anything (a token or a reply): a health probe's evidence.
        self.last_progress = time.monotonic()
        self._commands: deque[tuple[Callable, Future]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.stats = {"steps": 0, "generated_tokens": 0, "prefill_tokens": 0, "finished": 0, "aborted": 0,
                      "last_step_time": time.time()}
        # Calibration records for the simulator (a MetricsWriter, or None outside an experiment).
        self.metrics = metrics
        self.window = GenWindow(metrics_interval_s if metrics is not None else 0.0)
        self._paused_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="gen-engine", daemon=True)
        self._thread.start()

    # ---- thread-safe API (any thread) -------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between steps; its result arrives in the Future."""
        fut: Future = Future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify()
        return fut

    def submit(self, reqs: list[Request]) -> Future:
        def add():
            active = {r.rid for r in self.running} | {r.rid for r in self.waiting}
            for r in reqs:
                if r.rid in active:
                    raise ValueError(f"Duplicate request ID {r.rid!r}")
            self.window.submitted(len(reqs))
            for r in reqs:
                r.generator = request_generator(
                    r.params.sampling_seed if r.params.sampling_seed is not None
                    else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item()))
                self.waiting.append(r)
        return self.call(add)

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted by abort_request") -> Future:
        """Abort matching requests; running ones return what they generated so far."""
        def run():
            hit = [r for r in list(self.running) + list(self.waiting) if abort_all or (rid and r.rid.startswith(rid))]
            for r in hit:
                self._finish(r, {"type": "abort", "message": message})
            return len(hit)
        return self.call(run)

    def pause(self, mode: str) -> Future:
        def run():
            if mode == "abort":
                for r in list(self.running) + list(self.waiting):
                    self._finish(r, {"type": "abort", "message": "Aborted by pause_generation"})
            elif mode == "retract":
                self._retract_all()
            self.paused = mode
            if self._paused_at is None:
                self._paused_at = time.perf_counter()
        return self.call(run)

    def resume(self) -> Future:
        def run():
            self.paused = None
            if self._paused_at is not None and self.metrics is not None:
                # How long generation stood still (pause, weight load, continue): the simulator's
                # per-server load time under interruptible generation.
                self.metrics.log(event="gen_pause", gen_paused_s=time.perf_counter() - self._paused_at,
                                 weight_version=self.weight_version)
            self._paused_at = None
        return self.call(run)

    def when_idle(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread once no request is generating: at once when paused, else
        after the running and waiting requests finish (the HTTP layer holds new ones back)."""
        fut: Future = Future()

        def register():
            if self._pending_idle is not None:
                fut.set_exception(RuntimeError("another weight update is in progress"))
            else:
                self._pending_idle = (fn, fut)
        self.call(register)
        return fut

    def apply_update(self, copy: Callable[[], None], version: str | None, flush_cache: bool) -> bool:
        """On the engine thread (from `when_idle`): copy new weights in, record the version change,
        drop the KV cache of the old weights. False when the cache could not be flushed: as in
        SGLang, an `in_place` pause keeps its running batch with its (now stale) KV cache, and a
        flush with requests running is refused (the weights are updated all the same)."""
        t0 = time.perf_counter()
        copy()
        if self.metrics is not None:
            self.metrics.log(event="weight_load", weight_load_s=time.perf_counter() - t0,
                             weight_version=version or self.weight_version)
        self.record_version_change(version)
        if self.paused == "in_place" and self.running:
            return not flush_cache
        self._retract_all()        # KV built with the old weights is invalid
        return True

    def record_version_change(self, new_version: str | None) -> None:
        """On the engine thread: every held request with output so far remembers where the old
        version's tokens end (SGLang's `record_weight_version_change`)."""
        if new_version is None or new_version == self.weight_version:
            return
        for r in list(self.running) + list(self.waiting):
            if r.output_ids:
                r.version_changes.append(VersionChange(self.weight_version, len(r.output_ids)))
        self.weight_version = new_version

    def flush_cache(self) -> Future:
        """True when nothing holds a KV cache (waiting requests count only when not paused, as in
        SGLang's `is_fully_idle(ignore_waiting=paused)`)."""
        return self.call(lambda: not self.running and (bool(self.paused) or not self.waiting))

    def load(self) -> dict:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_tokens": sum(self.kv.lengths), "paused": self.paused,
                "num_waiting_tokens": sum(len(r.prompt_ids) + len(r.output_ids) for r in list(self.waiting)),
                "num_retracted_reqs": sum(1 for r in list(self.waiting) if r.output_ids),
                "gen_throughput": self._throughput[2] if time.perf_counter() - self._throughput[0] < 2.0 else 0.0}

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop:
                self._take_commands()
                self._maybe_run_idle()
                if self.window.due(time.perf_counter()):
                    self._log_window()
                if self.paused or not (self.running or self.waiting):
                    continue
                try:
                    self._admit()
                    if self.running:
                        self._decode_step()
                except Exception as e:  # keep serving: fail what was in flight, not the server
                    log.exception("generation step failed")
                    # (a request a failed prefill had taken is in neither list: answer it too)
                    taken = [r for r in self._admitting if r.finish is None and r not in self.running]
                    self._admitting = []
                    for r in list(self.running) + list(self.waiting) + taken:
                        self._finish(r, {"type": "abort", "message": f"internal error: {e}"})
                    self.kv.clear()
            if self.metrics is not None:
                self._log_window()  # the last partial window

    def _log_window(self) -> None:
        record = self.window.flush(time.perf_counter())
        if record:
            self.metrics.log(**record)

    def _take_commands(self) -> None:
        with self._wake:
            busy = (self.running or self.waiting) and not self.paused
            # Not asleep when an update waits for this idle moment: it runs now, not at the next
            # wake (up to half a second later, on every drained non-interruptible update).
            if not self._commands and not busy and self._pending_idle is None and not self._stop:
                t0 = time.perf_counter()
                self._wake.wait(timeout=0.5)
                self.window.idle(time.perf_counter() - t0)
            commands, self._commands = list(self._commands), deque()
        for fn, fut in commands:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def _maybe_run_idle(self) -> None:
        if self._pending_idle is None or not (self.paused or not (self.running or self.waiting)):
            return
        fn, fut = self._pending_idle
        self._pending_idle = None
        try:
            fut.set_result(fn())
        except Exception as e:
            fut.set_exception(e)

    def _retract_all(self) -> None:
        for r in reversed(self.running):
            r.pending = None
            self.waiting.appendleft(r)
        self.running = []
        self.kv.clear()

    def _admit(self) -> None:
        """Prefill waiting requests (one pass per distinct sequence) and join them to the running
        batch together: after a weight update the whole held batch comes back through here."""
        from transformers import DynamicCache
        budget = self.prefill_budget
        joining: list[tuple[Request, DynamicCache, int]] = []
        while self.waiting and len(self.running) + len(joining) < self.max_running and budget > 0:
            r = self.waiting.popleft()
            if r.params.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                continue
            group = [r] + self._same_prompt(r, self.max_running - len(self.running) - len(joining) - 1)
            self._admitting += group
            seq = r.prompt_ids + r.output_ids
            cache = DynamicCache(config=self.model.config)
            t0 = time.perf_counter()
            ids = torch.tensor([seq], device=self.device)
            self.routing.clear()
            logits = self.model(input_ids=ids, **with_cache(self.model, cache), use_cache=True).logits[0]
            routed = self.routing.take() if any(g.return_routed_experts for g in group) else None
            self.window.prefill(time.perf_counter() - t0, len(seq))
            self.stats["prefill_tokens"] += len(seq)
            budget -= len(seq)
            last = logits[-1:].expand(len(group), -1)
            tokens, lps = sample_rows(last, [g.params for g in group], [g.generator for g in group])
            for g, token, lp in zip(group, tokens, lps, strict=True):
                _keep_routing(g, routed)
                if g.logprob_start_len >= 0 and g.input_logprobs is None:
                    g.input_logprobs = self._input_logprobs(g, logits)
                if not self._append(g, token, lp):
                    g.pending = token
                    joining.append((g, cache, len(seq)))
        if joining:
            # Copies only the joining rows: its time is request handling (`gen_overhead_s`).
            order = self.kv.add_many([(cache, length) for _, cache, length in joining])
            rows = self.running + [g for g, _, _ in joining]
            self.running = [rows[i] for i in order]
        self._admitting = []

    def _same_prompt(self, r: Request, room: int) -> list[Request]:
        """Up to `room` fresh waiting requests with r's exact prompt (a GRPO group's n samples):
        they share one prefill, each sampling its own first token from the same logits."""
        if r.output_ids or room <= 0:
            return []
        # A group's samples arrive together: looking at the front of the queue finds them, and
        # keeps each admission's cost bounded however long the queue (tens of thousands of
        # requests once made every admission scan and shift all of them).
        same = [w for w in itertools.islice(self.waiting, SAME_PROMPT_SCAN) if not w.output_ids
                and w.params.max_new_tokens > 0 and w.prompt_ids == r.prompt_ids][:room]
        if same:
            taken = {id(w) for w in same}
            self.waiting = deque(w for w in self.waiting if id(w) not in taken)
        return same

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        context, padded, passes = sum(self.kv.lengths), self.kv.padded_entries, self.kv.passes
        ids = torch.tensor([[r.pending] for r in self.running], device=self.device)
        self.routing.clear()
        logits = self.kv.decode(self.model, ids)
        routed = self.routing.take() if any(r.return_routed_experts for r in self.running) else None
        if routed is not None:
            for i, r in enumerate(self.running):
                _keep_routing(r, routed[i:i + 1])
        tokens, lps = sample_rows(logits, [r.params for r in self.running], [r.generator for r in self.running])
        done = []
        for i, r in enumerate(self.running):
            if self._append(r, tokens[i], lps[i], remove_row=False):
                done.append(i)
            else:
                r.pending = tokens[i]
        self._drop_rows(done)
        self.window.decode_step(time.perf_counter() - t0, len(ids), context, padded, passes)
        self.stats["steps"] += 1
        self.stats["last_step_time"] = time.time()
        self.last_progress = time.monotonic()
        mark_t, mark_tokens, rate = self._throughput
        now = time.perf_counter()
        if now - mark_t >= 1.0:
            tokens = self.stats["generated_tokens"]
            self._throughput = (now, tokens, (tokens - mark_tokens) / (now - mark_t))

    def _drop_rows(self, rows: list[int]) -> None:
        if rows:
            self.running = [self.running[i] for i in self.kv.remove(rows)]

    def _append(self, r: Request, token: int, logprob: float, remove_row: bool = True) -> bool:
        """Record a sampled token; finish the request if it hit a stop condition."""
        r.output_ids.append(token)
        r.output_logprobs.append(logprob)
        self.stats["generated_tokens"] += 1
        if r.on_token is not None:
            try:
                r.on_token(token, logprob)
            except Exception:
                log.exception("streaming a token of %s failed", r.rid)
        p = r.params
        reason = None
        if len(r.output_ids) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        elif len(r.prompt_ids) + len(r.output_ids) >= self.context_len:
            reason = {"type": "length", "length": len(r.output_ids)}
        elif (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            reason = {"type": "stop", "matched": token}
        elif p.stop:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in text:
                    reason, r.matched_stop = {"type": "stop", "matched": s}, s
                    break
        if reason is None:
            return False
        self._finish(r, reason, in_batch=not remove_row)
        return True

    def _finish(self, r: Request, reason: dict, in_batch: bool = False) -> None:
        """Deliver the response and forget the request (`in_batch`: the caller removes its row)."""
        if not in_batch:
            if r in self.waiting:
                self.waiting.remove(r)
            elif r in self.running:
                self._drop_rows([self.running.index(r)])
        r.finish = reason
        self.stats["aborted" if reason["type"] == "abort" else "finished"] += 1
        self.last_progress = time.monotonic()
        try:
            r.on_done(self._response(r))
        except Exception:
            log.exception("delivering the response of %s failed", r.rid)

    def _response(self, r: Request) -> dict:
        p = r.params
        ids = r.output_ids
        if r.finish["type"] == "stop" and isinstance(r.finish.get("matched"), int) and not p.no_stop_trim:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if r.matched_stop and not p.no_stop_trim:
            text = text[:text.find(r.matched_stop)]
        meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.output_ids), "cached_tokens": 0,
                "weight_version": self.weight_version, "e2e_latency": time.time() - r.t_submit}
        add_to_meta(meta, spans(r.version_changes, self.weight_version, len(r.output_ids)))
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, self._token_text(r, t)]
                                             for lp, t in zip(r.output_logprobs, r.output_ids, strict=True)]
            if r.input_logprobs is not None:
                meta["input_token_logprobs"] = r.input_logprobs
        if r.return_routed_experts and self.routing.enabled:
            meta["routed_experts"] = encode(r.routed, r.routed_experts_start_len)
        return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}

    def _token_text(self, r: Request, token: int) -> str | None:
        return self.tokenizer.decode([token]) if r.return_text_in_logprobs else None

    def _input_logprobs(self, r: Request, logits: torch.Tensor) -> list:
        start = min(r.logprob_start_len, len(r.prompt_ids) - 1)
        logp = torch.log_softmax(logits.float() / logprob_temperature(r.params), dim=-1)
        # One gather and one copy to the CPU (not a device sync per prompt token).
        scored = range(max(start, 1), len(r.prompt_ids))
        picked = logp[[pos - 1 for pos in scored], [r.prompt_ids[pos] for pos in scored]].tolist()
        lps = [None] * (len(r.prompt_ids) - start - len(picked)) + picked
        out = []
        for pos, lp in zip(range(start, len(r.prompt_ids)), lps, strict=True):
            t = r.prompt_ids[pos]
            out.append([lp, t, self._token_text(r, t)])
        return out


def _keep_routing(r: Request, routed: torch.Tensor | None) -> None:
    """Keep the routing of the positions `r` had not been fed before (`routed` covers its whole
    fed sequence after a prefill, one position after a decode step): a re-prefilled position
    keeps its first routing, the one its next token was sampled under."""
    if routed is None or not r.return_routed_experts:
        return
    fed = len(r.prompt_ids) + len(r.output_ids)      # before this step's token is appended
    new = routed[len(routed) - (fed - r.routed_len):] if fed > r.routed_len else routed[:0]
    if len(new):
        r.routed.append(new)
        r.routed_len += len(new)


def request_generator(seed: int) -> torch.Generator:
    """A request's own sampling generator: on the CPU, whatever device the model is on.

    `sample_rows` draws one uniform number per row per token from it and moves the numbers to
    the logits' device. A CPU generator keeps a seeded request's draws bit for bit what they are
    on a CPU server (the seeded-reproducibility tests), makes them the same on a CUDA server (a
    CUDA generator's stream differs from the CPU's for the same seed), and costs one scalar per
    row per step, nothing beside the decode step's forward; a per-request CUDA generator would
    also hold device state for every waiting request."""
    return torch.Generator().manual_seed(seed)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
