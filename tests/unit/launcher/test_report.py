"""The run report: smoothed curves, the held-out curve from before/during/after, whole-version
staleness bins, the zoomed timeline window, and a page that leads with the headline figures."""
from __future__ import annotations

import json

import pytest
from synthetic_run import write_synthetic_run

from tandem.launcher.report import build_figure, held_out_points, smooth, write_report, zoom_window
from tandem.services.protocol import ExpDir, read_metrics


def test_smoothing_is_a_centred_mean_that_shrinks_at_the_ends():
    assert smooth([0, 3, 6, 9, 12], window=3) == [1.5, 3.0, 6.0, 9.0, 10.5]
    assert smooth([1, 1, 1]) == [1, 1, 1]
    noisy = [(-1) ** i for i in range(60)]   # +1/-1 alternating: the trend is 0
    assert max(abs(v) for v in smooth(noisy)) <= 1 / 3 and max(abs(v) for v in smooth(noisy)[3:-3]) <= 0.2


def test_zoom_window_is_the_middle_of_the_run():
    assert zoom_window(100.0) == (40.0, 60.0)
    assert zoom_window(12.0) == (0.0, 12.0)


def test_held_out_points_span_before_during_and_after(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=30, eval_every=10)
    points = held_out_points(exp, read_metrics(exp), last_step=30)
    assert [(p["step"], p["source"]) for p in points] == [(0, "before"), (10, "during"), (20, "during"), (30, "after")]
    before = points[0]
    assert before["se"] == pytest.approx((0.3 * 0.7 / 500) ** 0.5)   # derived when the file has none
    assert points[-1]["se"] == 0.0205


def test_figure_panels_show_trends_integer_bins_and_the_zoom(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=60, step_s=2.0)
    fig, counts = build_figure(exp)
    assert counts == {"steps": 60, "groups": 240, "weight_syncs": 60, "held_out_points": 7, "notes": {}}
    axes = fig.axes
    reward = axes[0]
    raw, smoothed = reward.lines[0].get_ydata(), reward.lines[1].get_ydata()
    # the raw reward jumps by 0.6 between steps; the smoothed one rises steadily
    assert max(abs(a - b) for a, b in zip(raw[1:], raw[:-1], strict=False)) > 0.5
    assert max(abs(a - b) for a, b in zip(smoothed[5:-5], smoothed[4:-6], strict=False)) < 0.6 / 4
    accuracy = axes[1]
    assert accuracy.containers, "held-out accuracy drawn with error bars"
    staleness = next(a for a in axes if a.get_title() == "staleness histogram")
    assert list(staleness.get_xticks()) == [0, 1, 2]
    mismatch = next(a for a in axes if a.get_title().startswith("training-inference mismatch"))
    assert mismatch.get_yscale() == "log" and len(mismatch.lines[0].get_xdata()) == 60
    zoom = next(a for a in axes if a.get_title().startswith("timeline, 20 s"))
    lo, hi = zoom.get_xlim()
    assert hi - lo == pytest.approx(20.0)


def test_page_leads_with_the_headline_figures(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=20)
    png, page, _ = write_report(exp)
    text = page.read_text()
    assert "30.0% → 70.0%" in text and "trajectories/s" in text
    assert png.stat().st_size > 10_000


def test_eval_records_of_the_before_and_after_evaluations_replace_their_files(tmp_path):
    """A run whose `tandem eval --tag` logged its before/after results reads them from the
    records (the files are the fallback of older runs), each once."""
    import json
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=30, eval_every=10)
    with exp.metrics.open("a") as f:
        for tag, step, acc in (("before", 0, 0.31), ("after", 30, 0.69)):
            f.write(json.dumps({"time": 0, "role": "eval", "event": "eval", "tag": tag, "step": step,
                                "eval_accuracy": acc, "eval_se": 0.02, "eval_n": 500}) + "\n")
    points = held_out_points(exp, read_metrics(exp), last_step=30)
    assert [(p["step"], p["source"], p["accuracy"]) for p in points] == [
        (0, "before", 0.31), (10, "during", 0.3 + 0.4 * 10 / 30), (20, "during", 0.3 + 0.4 * 20 / 30),
        (30, "after", 0.69)]


def test_a_multi_turn_run_also_draws_the_first_turn(tmp_path):
    import json
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=20, eval_every=10)
    with exp.metrics.open("a") as f:
        for tag, step, acc, first in (("before", 0, 0.30, 0.25), ("after", 20, 0.60, 0.45)):
            f.write(json.dumps({"time": 0, "role": "eval", "event": "eval", "tag": tag, "step": step,
                                "eval_accuracy": acc, "eval_se": 0.02, "eval_n": 177,
                                "eval_first_turn_accuracy": first}) + "\n")
    fig, _ = build_figure(exp)
    first = [line for line in fig.axes[1].lines if line.get_label().startswith("held-out, first turn")]
    assert len(first) == 1
    assert list(first[0].get_xdata()) == [0, 20] and list(first[0].get_ydata()) == [25.0, 45.0]


def test_the_timeline_marks_each_continuation_by_its_cause_and_the_text_lists_them(tmp_path):
    """A resume the launcher made by itself (launcher/continuation.py: a `continued` record, then
    the launch's `resumed` mark) is labelled by its cause; a resume by hand stays "resumed"."""
    from tandem.launcher.report import report_text

    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=20)
    times = sorted(r["time"] for r in read_metrics(exp))
    first, second = times[len(times) // 3], times[2 * len(times) // 3]
    with (exp.root / "metrics.jsonl").open("a") as f:
        for rec in ({"event": "resumed", "resumed_at": first, "time": first},
                    {"event": "continued", "failed_role": "trainer-0", "cause": "NODE_FAIL", "attempt": 1,
                     "time": second - 5},
                    {"event": "resumed", "resumed_at": second, "time": second}):
            f.write(json.dumps({"role": "launcher", "rank": 0, **rec}) + "\n")
    fig, _ = build_figure(exp)
    whole = next(a for a in fig.axes if a.get_title().startswith("timeline: generation"))
    assert [t.get_text() for t in whole.texts if t.get_text() in ("resumed", "continued #1: NODE_FAIL")] == [
        "resumed", "continued #1: NODE_FAIL"]
    png, page, counts = write_report(exp)
    text = report_text(exp, png, page, counts)
    assert "resumed 2x (1 by the launcher itself)" in text
    assert "continued by the launcher: #1 after trainer-0 NODE_FAIL at " in text
