"""The embedded server's calibration window: step-weighted means, and nothing for an idle window."""
from __future__ import annotations

import pytest

from rollout.server.window import GenWindow


def test_a_window_reports_step_weighted_means_and_the_unexplained_time():
    w = GenWindow(interval_s=5.0)
    start = w.start
    w.decode_step(0.010, running=10, context_tokens=1000)
    w.decode_step(0.030, running=30, context_tokens=5000)
    w.prefill(0.004, tokens=40)
    w.idle(1.0)
    w.submitted(8)
    assert not w.due(start + 4.9) and w.due(start + 5.0)
    rec = w.flush(start + 2.0)
    assert rec["gen_running"] == 20 and rec["gen_context_tokens"] == 3000
    # 40 tokens decoded in 0.04 s of decode steps (not per wall-clock second).
    assert rec["gen_tokens_per_s"] == pytest.approx(1000)
    assert (rec["gen_prefills"], rec["gen_prefill_tokens"], rec["gen_requests"]) == (1, 40, 8)
    assert rec["gen_overhead_s"] == pytest.approx(2.0 - 1.0 - 0.044)
    # flushing starts a new, empty window
    assert w.flush(start + 3.0) is None and w.start == start + 3.0


def test_a_disabled_window_is_never_due():
    assert not GenWindow(interval_s=0).due(1e12)


def test_joins_are_timed_apart_from_request_handling():
    # Joining a batch copies its resident KV cache: timed and sized separately, and not
    # counted as request handling.
    w = GenWindow(interval_s=5.0)
    start = w.start
    w.prefill(0.004, tokens=40)
    w.join(0.001, resident_kv_tokens=0)
    w.join(0.003, resident_kv_tokens=1200)
    rec = w.flush(start + 1.0)
    assert (rec["gen_join_s"], rec["gen_joins"], rec["gen_join_kv_tokens"]) == (pytest.approx(0.004), 2, 1200)
    assert rec["gen_overhead_s"] == pytest.approx(1.0 - 0.004 - 0.004)
