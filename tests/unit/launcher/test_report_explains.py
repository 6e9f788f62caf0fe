"""The report explains itself, on a real 10-step run with evaluation off (its records replayed,
tests/support/recorded_run.py): a title naming the run, its file, date and commit; a note in
each empty panel saying why; y-axes that do not turn noise into a trend or hide a value in an
offset label; resumed-at marks; and `tandem report` printing a summary, JSON with `--json`."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
from recorded_run import write_recorded_run
from synthetic_run import write_synthetic_run

from tandem.launcher.cli import main
from tandem.launcher.report import build_figure
from tandem.services.protocol import ExpDir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> ExpDir:
    return write_recorded_run(ExpDir(tmp_path_factory.mktemp("recorded") / "run"))


@pytest.fixture(scope="module")
def figure(run):
    """The recorded run's figure and counts, built once (about a second) for the tests that read it."""
    return build_figure(run)


def panel(fig, title_start: str):
    return next(a for a in fig.axes if a.get_title().startswith(title_start))


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_the_figure_is_titled_with_the_run_its_file_date_and_commit(figure):
    fig, _ = figure
    title = fig._suptitle.get_text()
    assert "Tandem run math-tiny" in title and "config: configs/math-tiny.yaml" in title
    assert "started: 2026-11-26 13:42 UTC" in title and "commit: 0e65a8c6aa7f" in title


def test_the_held_out_panel_says_evaluation_was_off(figure):
    fig, counts = figure
    accuracy = panel(fig, "accuracy")
    assert not accuracy.containers   # no held-out points ...
    why = "no held-out curve: evaluation off (rollout.eval_size and rollout.eval_every are 0)"
    assert counts["notes"][accuracy.get_title()] == why   # ... and the panel says why
    assert any("evaluation off" in t for t in texts(accuracy))


def test_other_empty_panels_say_why(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=10)
    lines = [json.loads(x) for x in exp.metrics.read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if not k.startswith("mismatch")} for r in lines if r.get("event") != "weight_sync"]
    exp.metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    fig, counts = build_figure(exp)
    assert "no weight sync recorded" in counts["notes"]["weight-sync phases"]
    mismatch = panel(fig, "training-inference mismatch")
    assert "no step trained a token generated at its own version" in counts["notes"][mismatch.get_title()]
    assert any("own version" in t for t in texts(mismatch))


def test_a_flat_reward_is_drawn_flat_and_its_value_printed(figure):
    fig, _ = figure
    reward = panel(fig, "reward")
    raw = list(reward.lines[0].get_ydata())
    assert -1.0 <= min(raw) and max(raw) <= -0.96     # the run's rewards: -1.0 to -0.97
    lo, hi = reward.get_ylim()
    assert hi - lo >= 0.5 - 1e-9, (lo, hi)            # a quarter of the reward's range (-1 to +1)
    assert lo <= -1.0 and hi < 1.0
    assert any(t.startswith("last -1 (smoothed); raw -1 to -0.9688") for t in texts(reward))


def test_the_mismatch_panel_is_readable(figure):
    fig, _ = figure
    fig.canvas.draw()
    mismatch = panel(fig, "training-inference mismatch")
    ratio = next(a for a in fig.axes if a is not mismatch and a.bbox.bounds == mismatch.bbox.bounds)
    for ax in fig.axes:   # no `1e-6+1`: no axis moves its values into an offset label
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_title()
    lo, hi = ratio.get_ylim()
    assert hi - lo >= 0.02 and lo < 1.0 < hi
    assert all("e" not in t.get_text() for t in ratio.get_yticklabels())
    # one step had tokens of its own version: one point, labelled with its values
    assert len(mismatch.lines[0].get_xdata()) == 1
    assert "3.384e-14" in texts(mismatch) and "1.000001" in texts(ratio)
    assert mismatch.get_xlim() == (0.5, 10.5)
    assert all(float(t).is_integer() for t in mismatch.get_xticks())


def test_a_resumed_run_is_marked_on_the_time_axes(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=10, step_s=2.0)
    # the trainer went back to its checkpoint at step 6 and trained step 7 again, 30 s later
    with exp.metrics.open("a") as f:
        for s in (7, 8):
            f.write(json.dumps({"time": 1_000_000.0 + 50 + 2 * s, "role": "trainer", "event": "step", "step": s,
                                "step_s": 2.0, "reward_mean": 0.0}) + "\n")
    fig, counts = build_figure(exp)
    t0 = 1_000_000.0 + 2 - 3.0    # the first group's start (3 s before step 1 ends): the timeline's 0
    mark = 1_000_000.0 + 50 + 14 - 2.0 - t0
    timeline = panel(fig, "timeline: generation")
    vertical = [line for line in timeline.lines if list(line.get_xdata()) == [mark, mark]]
    assert vertical and "resumed" in texts(timeline)


@pytest.fixture(scope="module")
def reported(run) -> str:
    """`tandem report` on the recorded run, once: what it printed (its page is in run.report)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", "--exp", str(run.root)]) == 0
    return out.getvalue()


def test_report_prints_a_summary_and_json_when_asked(run, reported, capsys):
    out = reported
    lines = out.splitlines()
    assert lines[0] == f"Tandem run math-tiny ({run.root})"
    assert "config: configs/math-tiny.yaml" in lines[1]
    assert "10 training steps, 208 groups, 10 weight syncs, 0 held-out evaluations" in out
    assert "  empty panels:" in lines and any("evaluation off" in x for x in lines)
    assert lines[-2] == f"report: {run.report / 'report.html'}"
    assert main(["report", "--exp", str(run.root), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["png"] == str(run.report / "report.png") and result["steps"] == 10
    assert result["run"]["commit"].startswith("0e65a8c")


def test_the_page_carries_the_title_and_the_notes(run, reported):
    text = (run.report / "report.html").read_text()
    assert "<title>Tandem run math-tiny</title>" in text and "<h1>Tandem run math-tiny</h1>" in text
    assert "config: configs/math-tiny.yaml" in text and "evaluation off" in text
