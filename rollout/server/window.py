"""What one embedded server did over a metrics window: the numbers the simulator calibrates on.

`tandem simulate --calibrate EXP_DIR` fits a decode step's cost to its batch size and context,
and a prefill's cost to its calls and tokens. Wall-clock tokens/s cannot give those: it mixes
idle time, prefills and decode steps. So the engine times its decode steps and prefills
separately, and each window reports step-weighted means, for which the affine cost law holds
exactly (the mean of affine step times is the affine function of the means). The rest of the
engine thread's time, neither idle nor computing, is request handling (submitting, aborting,
answering, copying prefilled rows into the running batch; on CPU it competes with the HTTP
thread for the GIL): `gen_overhead_s` over `gen_requests` prices it per request.

Window means cannot separate a step's cost per row from its cost per context token when both
grow together, as they do over a window of a synchronous run. So each window also carries the
sums of products over its steps (`gen_decode_moments`) of (forward passes, rows, padded KV
entries) and the step time: pooled over windows they are the normal equations of the
least-squares fit over every single step. Padded entries (each row padded to the longest of its
rectangle, `kv_rows.py`) are what the embedded server attends over; a step takes one forward
pass, or two when long rows decode apart (`cohorts.py`).
"""
from __future__ import annotations

import time

# Sums over decode steps of 1 and of products of f (forward passes), n (rows), p (padded KV
# entries) and t (seconds).
MOMENTS = ("1", "f", "n", "p", "ff", "fn", "fp", "nn", "np", "pp", "t", "tf", "tn", "tp", "tt")


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
        self.moments = dict.fromkeys(MOMENTS, 0.0)
        self.prefill_s = 0.0
        self.prefills = 0
        self.prefill_tokens = 0
        self.idle_s = 0.0         # the engine thread waiting for work (or paused)
        self.requests = 0         # requests submitted (fresh and resubmitted after an interrupt)

    def decode_step(self, seconds: float, running: int, context_tokens: int, padded_tokens: int,
                    passes: int = 1) -> None:
        self.decode_s += seconds
        self.steps += 1
        self.running_sum += running
        self.context_sum += context_tokens
        m = self.moments
        m["1"] += 1
        x = {"f": passes, "n": running, "p": padded_tokens, "t": seconds}
        for key in MOMENTS[1:]:
            m[key] += x[key] if len(key) == 1 else x[key[0]] * x[key[1]]

    def prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefills += 1
        self.prefill_tokens += tokens

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
                   "gen_idle_s": self.idle_s,
                   "gen_overhead_s": max(0.0, window - self.idle_s - self.decode_s - self.prefill_s),
                   "gen_busy": (self.decode_s + self.prefill_s) / max(window, 1e-9)}
            if self.steps:
                rec.update(gen_tokens_per_s=self.running_sum / max(self.decode_s, 1e-9),
                           gen_running=self.running_sum / self.steps,
                           gen_context_tokens=self.context_sum / self.steps,
                           gen_decode_moments=dict(self.moments))
        self._reset(now)
        return rec
