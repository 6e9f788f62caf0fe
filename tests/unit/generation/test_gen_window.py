"""The embedded server's calibration window: step-weighted means, and nothing for an idle window."""
from __future__ import annotations

import pytest

from tandem.rollout.server.window import GenWindow


def test_a_window_reports_step_weighted_means_and_the_unexplained_time():
    w = GenWindow(interval_s=5.0)
    start = w.start
    w.decode_step(0.010, running=10, context_tokens=1000, padded_tokens=1200)
    w.decode_step(0.030, running=30, context_tokens=5000, padded_tokens=9000)
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
    # the per-step sums behind the calibration's least squares
    m = rec["gen_decode_moments"]
    assert (m["1"], m["f"], m["n"], m["p"], m["np"]) == (2, 2, 40, 10200, 10 * 1200 + 30 * 9000)
    assert (m["t"], m["tp"]) == (pytest.approx(0.04), pytest.approx(0.010 * 1200 + 0.030 * 9000))
    # flushing starts a new, empty window
    assert w.flush(start + 3.0) is None and w.start == start + 3.0


def test_a_disabled_window_is_never_due():
    assert not GenWindow(interval_s=0).due(1e12)
