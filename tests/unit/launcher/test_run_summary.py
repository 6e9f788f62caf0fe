"""summary.json and the progress lines after a --resume: one run, each step counted once."""
from __future__ import annotations

import json

from tandem.launcher.progress import Progress, mark_resumed, run_steps, summarize
from tandem.services.protocol import MetricsWriter, read_metrics


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


def _groups(exp, correct: dict[str, float]):
    writer = MetricsWriter(exp, "rollout")
    for gid, c in correct.items():
        writer.log(event="group", group_id=gid, correct=c)
    writer.close()


def _progress_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_progress_says_the_accuracy_of_the_groups_each_step_trained(exp, capsys):
    """After a resume the first step trains groups the earlier launch generated (the trainer's
    checkpoint held them): no group record arrives before it in this launch, and the line once
    said `sample accuracy nan%`. The accuracy is now that of the step's own groups."""
    _groups(exp, {"a": 1.0, "b": 0.0, "c": 0.5, "d": 1.0})      # first launch: a, b trained, c, d held
    _steps(exp, [1], group_ids=["a", "b"])
    mark_resumed(exp)
    progress = Progress(exp, total_steps=3, resume=True)
    _steps(exp, [2], group_ids=["c", "d"])
    _groups(exp, {"e": 0.25, "f": 0.25})
    _steps(exp, [3], group_ids=["e", "f", "unknown"])
    progress.update()
    lines = _progress_lines(capsys)
    assert [line.split(" | ")[2] for line in lines] == ["sample accuracy 75%", "sample accuracy 25%"]
    _steps(exp, [4], group_ids=["never-recorded"])
    progress.update()
    assert _progress_lines(capsys)[0].split(" | ")[2] == "sample accuracy -"


def test_resumed_throughput_counts_only_this_launchs_steps(exp):
    """Two steps a second apart, a 1000 s gap, then three steps a second apart after the resume:
    this launch trained 12 trajectories in 2 s, not 20 in 1002 s."""
    writer = MetricsWriter(exp, "trainer")
    for step, t in ((1, 100.0), (2, 101.0)):
        writer.log(event="step", step=step, n_seqs=4, train_tokens=100, step_s=1.0, time=t)
    mark = mark_resumed(exp)
    for step, t in ((2, 1101.0), (3, 1102.0), (4, 1103.0)):
        writer.log(event="step", step=step, n_seqs=4, train_tokens=100, step_s=1.0, time=t)
    writer.close()
    summary = summarize(exp, {}, 5.0)
    assert summary["steps"] == 4
    assert summary["throughput"] == {"trajectories_per_s": 6.0, "tokens_per_s": 150.0, "steps": 3}
    assert summary["rl_s"] == 3.0
    # The mark the report draws: when, and after which step, in the run's own stream.
    recorded = read_metrics(exp, "launcher", "resumed")
    assert recorded == [{"time": recorded[0]["time"], "role": "launcher", "rank": 0, **mark}]
    assert mark["last_step"] == 2 and mark["resumed_at"] > 0


def test_a_run_never_resumed_counts_all_its_steps(exp):
    writer = MetricsWriter(exp, "trainer")
    for step, t in ((1, 100.0), (2, 102.0), (3, 104.0)):
        writer.log(event="step", step=step, n_seqs=4, train_tokens=100, step_s=2.0, time=t)
    writer.close()
    assert summarize(exp, {}, 5.0)["throughput"] == {"trajectories_per_s": 3.0, "tokens_per_s": 75.0, "steps": 3}
