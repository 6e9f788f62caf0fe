"""What the launcher says about learning, from the run's records (launcher/learning.py,
progress.py, report_records.py): the trainer's warnings beside the progress lines, in
summary.json and the report; why the trainer stopped the run; the verdict on held-out accuracy
with its noise and, when it did not rise, the reasons; and the last sample completions."""
from __future__ import annotations

import json

from synthetic_run import write_synthetic_run

from tandem.launcher.learning import unfinished_warm_up, verdict
from tandem.launcher.progress import Progress, summarize
from tandem.launcher.report import report_text, write_report
from tandem.services.protocol import ExpDir, MetricsWriter

NO_SIGNAL = "no reward signal for 10 steps: every trained group's samples got the same reward"
CAP = "dynamic sampling (rollout.filter_all_equal) dropped 320 groups in a row. That reached the cap: the run stops"


def test_progress_prints_the_trainers_warnings_between_its_steps(exp, capsys):
    trainer = MetricsWriter(exp, "trainer")
    progress = Progress(exp, total_steps=20)
    trainer.log(event="step", step=10, reward_mean=-5.0, tokens_per_s=100.0)
    trainer.log(event="warning", kind="no_reward_signal", step=10, count=10, message=NO_SIGNAL)
    trainer.log(event="step", step=11, reward_mean=-5.0, tokens_per_s=100.0)
    progress.update()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 10/20", f"warning: {NO_SIGNAL}", "step 11/20"]


def test_the_summary_holds_the_warnings_the_stop_and_the_verdict(exp):
    trainer = MetricsWriter(exp, "trainer")
    trainer.log(event="step", step=1, n_seqs=4, train_tokens=10, step_s=1.0, staleness_hist_total={"0": 2})
    trainer.log(event="warning", kind="rejected_cap", step=1, count=320, message=CAP)
    trainer.log(event="run_stopped", step=1, reason=CAP)
    summary = summarize(exp, {"before": {"accuracy": 0.028, "n": 500}, "after": {"accuracy": 0.018, "n": 500}}, 1.0)
    assert summary["warnings"] == [{"kind": "rejected_cap", "step": 1, "count": 320, "message": CAP}]
    assert summary["stopped"] == CAP
    assert summary["verdict"].startswith("held-out accuracy did not rise: 2.8% → 1.8% (-1.0 points, n = 500; two "
                                         "standard errors of the difference: 1.9 points). Why: the starting policy "
                                         "was right on 2.8% of the held-out problems")
    assert f"the run warned: {CAP}" in summary["verdict"] and f"the run stopped early: {CAP}" in summary["verdict"]
    assert json.loads((exp.root / "summary.json").read_text())["stopped"] == CAP


def test_the_verdict_tells_a_gain_from_noise_and_names_a_cut_short_warm_up(tmp_path):
    rose = verdict({"eval": {"before": 0.482, "after": 0.630, "n": 500}}, [])
    assert rose == ("held-out accuracy rose: 48.2% → 63.0% (+14.8 points, n = 500; two standard errors of the "
                    "difference: 6.2 points)")
    noise = verdict({"eval": {"before": 0.50, "after": 0.52, "n": 100}}, [])
    assert noise.startswith("held-out accuracy rose within noise: 50.0% → 52.0%")
    assert "the run's records name no cause" in noise
    assert verdict({"eval": {"before": None, "after": 0.5, "n": 0}}, []) is None
    model = tmp_path / "tiny-math-sft"      # the marker an earlier version cached for a cut-short warm-up
    model.mkdir()
    (model / "sft.json").write_text(json.dumps({"steps": 376, "greedy_accuracy": 0.095, "settings": {"max_steps": 1000}}))
    said = verdict({"eval": {"before": 0.028, "after": 0.018, "n": 500}}, [], model)
    assert f"Why: experiment.model {model} is a warm-up stopped at step 376 of 1000 (greedy accuracy 0.095)" in said
    (model / "sft.json").write_text(json.dumps({"steps": 1000, "complete": True, "settings": {"max_steps": 1000}}))
    assert unfinished_warm_up(model) is None


def test_the_report_shows_the_learning_lines_and_the_last_samples(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=6)
    trainer = MetricsWriter(exp, "trainer")
    trainer.log(event="warning", kind="no_reward_signal", step=3, count=10, message=NO_SIGNAL)
    trainer.log(event="warning", kind="no_reward_signal", step=6, count=20, message=NO_SIGNAL)
    for step in (2, 4, 6):
        trainer.log(event="samples", step=step, samples=[
            {"group_id": f"0-{step}", "sample_idx": 0, "prompt": "What is <b>1+1</b>?", "response": f"\\boxed{{{step}}}",
             "reward": -5.0, "version_min": step - 1, "version_max": step}])
    png, page, counts = write_report(exp)
    text = page.read_text()
    assert f"warning (2 times, the last at step 6): {NO_SIGNAL}" in text
    # the last two sample records, newest first, their text escaped
    assert text.index("<h3>step 6</h3>") < text.index("<h3>step 4</h3>") and "<h3>step 2</h3>" not in text
    assert "What is &lt;b&gt;1+1&lt;/b&gt;?" in text and "\\boxed{6}" in text and "v5–v6" in text
    assert counts["sample_records"] == 3
    assert f"  warning (2 times, the last at step 6): {NO_SIGNAL}" in report_text(exp, png, page, counts)
