"""What one embedded server did over a metrics window: the numbers the simulator calibrates on.

`tandem simulate --calibrate EXP_DIR` fits a decode step's cost to its batch size and context,
and a prefill's cost to its calls and tokens. Wall-clock tokens/s cannot give those: it mixes
idle time, prefills and decode steps. So the engine times its decode steps and prefills
separately, and each window reports step-weighted means, for which the affine cost law holds
exactly (the mean of affine step times is the affine function of the means). The rest of the
engine thread's time, neither idle nor computing, is request handling (submitting, aborting,
answering; on CPU it competes with the HTTP thread for the GIL): `gen_overhead_s` over
`gen_requests` prices it per request. Joining a running batch copies its whole (padded) KV
cache, so joins are timed apart (`gen_join_s`, with the KV entries resident at each join
summed in `gen_join_kv_tokens`): cheap into the small batches of a synchronous step, costly
when a weight update sends a full batch back through admission.
"""
from __future__ import annotations

import time


class GenWindow:
    """Accumulated on the engine thread; `flush()` returns one metrics record and starts anew."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.start = now
        self.decode_s = 0.0
        self.steps = 0
        self.running_sum = 0      # sum over decode steps of the batch size (= tokens decoded)
        self.context_sum = 0      # sum over decode steps of the tokens held in the KV cache
        self.prefill_s = 0.0
        self.prefills = 0
        self.prefill_tokens = 0
        self.idle_s = 0.0         # the engine thread waiting for work (or paused)
        self.requests = 0         # requests submitted (fresh and resubmitted after an interrupt)
        self.join_s = 0.0         # adding a prefilled row to the running batch's KV cache
        self.joins = 0
        self.join_kv_tokens = 0   # sum over joins of the KV entries (rows x width) already resident

    def decode_step(self, seconds: float, running: int, context_tokens: int) -> None:
        self.decode_s += seconds
        self.steps += 1
        self.running_sum += running
        self.context_sum += context_tokens

    def prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefills += 1
        self.prefill_tokens += tokens

    def join(self, seconds: float, resident_kv_tokens: int) -> None:
        self.join_s += seconds
        self.joins += 1
        self.join_kv_tokens += resident_kv_tokens

    def idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def submitted(self, n: int) -> None:
        self.requests += n

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self.start >= self.interval_s

    def flush(self, now: float) -> dict | None:
        """The window's record (None when nothing ran in it)."""
        rec = None
        if self.steps or self.prefills:
            window = now - self.start
            rec = {"event": "gen_window", "window_s": window,
                   "gen_decode_s": self.decode_s, "gen_steps": self.steps,
                   "gen_prefill_s": self.prefill_s, "gen_prefills": self.prefills,
                   "gen_prefill_tokens": self.prefill_tokens, "gen_requests": self.requests,
                   "gen_idle_s": self.idle_s, "gen_join_s": self.join_s, "gen_joins": self.joins,
                   "gen_join_kv_tokens": self.join_kv_tokens,
                   "gen_overhead_s": max(0.0, window - self.idle_s - self.decode_s - self.prefill_s
                                         - self.join_s),
                   "gen_busy": (self.decode_s + self.prefill_s) / max(window, 1e-9)}
            if self.steps:
                rec.update(gen_tokens_per_s=self.running_sum / max(self.decode_s, 1e-9),
                           gen_running=self.running_sum / self.steps,
                           gen_context_tokens=self.context_sum / self.steps)
        self._reset(now)
        return rec
