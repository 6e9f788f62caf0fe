"""What a report knows of its run: the launches file (experiment file, commit, time, resumes),
the commit read from a checkout's `.git` files, and resume marks of runs without the file."""
from __future__ import annotations

import json

from model_dirs import checked_model_dir

from tandem.launcher.run_info import (
    git_commit,
    read_launches,
    record_launch,
    resume_times,
    resume_times_from_steps,
    run_info,
)
from tandem.services.protocol import ExpDir

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_the_commit_is_read_from_a_branch_a_packed_ref_or_a_detached_head(tmp_path):
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(SHA + "\n")
    assert git_commit(tmp_path) == SHA
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{SHA} refs/heads/main\n")
    assert git_commit(tmp_path) == SHA
    (git / "HEAD").write_text(SHA[::-1] + "\n")
    assert git_commit(tmp_path) == SHA[::-1]
    assert git_commit(tmp_path / "elsewhere") is None


def test_this_checkout_has_a_commit():
    commit = git_commit()
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)


def test_each_launch_appends_its_file_and_time_and_a_resume_is_marked(tmp_path):
    first = record_launch(tmp_path, "configs/math-tiny.yaml", resume=False)
    again = record_launch(tmp_path, "configs/math-tiny.yaml", resume=True)
    launches = read_launches(tmp_path)
    assert [(r["config"], r["resume"]) for r in launches] == [("configs/math-tiny.yaml", False),
                                                              ("configs/math-tiny.yaml", True)]
    assert launches[0]["commit"] == git_commit()
    assert resume_times(tmp_path, []) == [again["time"]] and again["time"] >= first["time"]
    # the launcher's own mark in the metrics, where a resumed launch's figures start, comes first
    assert resume_times(tmp_path, [{"event": "resumed", "time": 5.0, "resumed_at": 4.0}]) == [4.0]


def test_without_the_file_a_resume_shows_in_the_trainers_step_numbers():
    steps = [{"role": "trainer", "event": "step", "step": s, "time": t, "step_s": 2.0}
             for s, t in ((1, 10.0), (2, 12.0), (3, 14.0), (3, 100.0), (4, 102.0))]
    assert resume_times_from_steps(steps) == [98.0]
    # a `resumed` record, where the run logged one, is taken as is
    assert resume_times("/nonexistent", steps + [{"event": "resumed", "time": 97.0}]) == [97.0]


def test_run_info_names_the_run_and_why_the_held_out_panel_is_empty(tmp_path):
    exp = ExpDir(tmp_path / "run")
    exp.root.mkdir()
    assert run_info(exp, []).why_no_held_out().endswith("(the run's config.yaml is missing)")
    exp.config.write_text("experiment: {name: math-tiny}\nrollout: {eval_size: 0, eval_every: 0}\n"
                          "reward: {correct_reward: 1.0, wrong_reward: -1.0}\n")
    record_launch(exp.root, "configs/math-tiny.yaml", resume=False)
    info = run_info(exp, [{"time": 0}])
    assert info.title() == "Tandem run math-tiny" and info.reward_range == (-1.0, 1.0)
    assert "config: configs/math-tiny.yaml" in info.subtitle() and " UTC" in info.subtitle()
    assert "evaluation off" in info.why_no_held_out()
    (exp.root / "launches.jsonl").write_text(json.dumps({"time": 1.0}) + "\nnot json\n")
    assert "commit: not recorded" in run_info(exp, []).subtitle()


def test_tandem_run_records_its_launches(tmp_path):
    """`prepare` (what `tandem run` does before starting anything) appends the launch."""
    from tandem.launcher.run import prepare
    checked_model_dir(tmp_path / "model")
    exp_yaml = tmp_path / "exp.yaml"
    exp_yaml.write_text(f"experiment: {{name: rec, model: {tmp_path / 'model'}, exp_dir: {tmp_path / 'rec'}}}\n"
                        "rollout: {dataset: 'synthetic:math'}\n")
    _, exp = prepare(str(exp_yaml), [], resume=False)
    prepare(str(exp_yaml), [], resume=True)
    assert [(r["config"], r["resume"]) for r in read_launches(exp.root)] == [(str(exp_yaml), False),
                                                                            (str(exp_yaml), True)]
