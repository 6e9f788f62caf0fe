"""summary.json and the progress lines after a --resume: one run, each step counted once."""
from __future__ import annotations

import json

from launcher.progress import Progress, run_steps, summarize
from services.protocol import MetricsWriter


def _steps(exp, numbers, **extra):
    writer = MetricsWriter(exp, "trainer")
    for n in numbers:
        writer.log(event="step", step=n, n_seqs=4, train_tokens=100, step_s=1.0,
                   staleness_hist_total={"0": 2 * n}, **extra)
    writer.close()


def test_a_resumed_run_counts_each_step_once(exp):
    """The first launch reached step 5, its last checkpoint was step 3; the resumed trainer
    trains 4, 5, 6: steps 4 and 5 of the first launch were an abandoned future."""
    _steps(exp, [1, 2, 3, 4, 5], launch=1)
    _steps(exp, [4, 5, 6], launch=2)
    records = [json.loads(line) for line in exp.metrics.read_text().splitlines()]
    steps = run_steps(records)
    assert [(r["step"], r["launch"]) for r in steps] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    summary = summarize(exp, {"before": {"accuracy": 0.25, "n": 8}, "after": {"accuracy": 0.5, "n": 8}}, 1.0)
    assert summary["steps"] == 6 and summary["eval"] == {"before": 0.25, "after": 0.5, "n": 8}
    assert summary["staleness"]["histogram"] == {"0": 12}


def test_the_summary_counts_groups_dropped_as_stale(exp):
    _steps(exp, [1, 2], buffer_dropped_stale=3)
    _steps(exp, [3], buffer_dropped_stale=7)
    assert summarize(exp, {}, 1.0)["staleness"]["dropped"] == 7


def test_other_records_do_not_disturb_the_step_sequence(exp):
    records = [{"event": "step", "step": 1}, {"event": "startup"}, {"event": "step", "step": 2},
               {"event": "step", "step": 2}]
    assert [r["step"] for r in run_steps(records)] == [1, 2]


def test_progress_after_resume_prints_only_the_new_steps(exp, capsys):
    _steps(exp, [1, 2, 3])
    progress = Progress(exp, total_steps=4, resume=True)
    _steps(exp, [3, 4])
    progress.update()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 3/4", "step 4/4"]
