"""The W&B tracking sink, fed by the follower from a synthetic metrics.jsonl: an offline run under
`<exp>/wandb/` holding exactly the forwarded rows, continued under the same id by a resumed
trainer, with nothing printed and no login. Integration tier: `wandb.init` starts W&B's own
service process (`wandb-core`), even offline.
"""
from __future__ import annotations

import importlib.util
import json
import time

import pytest
import yaml
from wandb_offline import config, history, run_record

from tandem.services.protocol import MetricsWriter
from tandem.services.protocol.trackers import TrackerFollower, WandbConfig, build_sinks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install 'tandem[trackers]'")


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """No key, no netrc, no user settings: what a fresh machine has."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "home" / sub))


def log_steps(exp, steps, eval_at=None):
    trainer, rollout = MetricsWriter(exp, "trainer"), MetricsWriter(exp, "rollout", 1)
    for s in steps:
        rollout.log(event="group", group_id=f"g{s}", correct=1.0)
        trainer.log(event="step", step=s, loss=0.5 / s, n_seqs=8, staleness_hist={"0": 4}, ack_ok=True)
    if eval_at is not None:
        rollout.log(event="eval", step=eval_at, eval_accuracy=0.5, eval_se=0.1, eval_n=25)
    trainer.close()
    rollout.close()


def follow(exp, mode="offline"):
    follower = TrackerFollower(exp, build_sinks(["wandb"], exp, WandbConfig(mode=mode), run_name="wb"))
    follower.open()
    follower.poll()
    follower.close()
    return follower


def offline_runs(exp):
    return sorted(p for p in (exp.root / "wandb").glob("offline-run-*") if p.is_dir())


def test_offline_run_holds_the_rows_and_a_resume_continues_its_id(exp, no_wandb_account, capfd):
    (exp.root / "config.yaml").write_text(yaml.safe_dump({"experiment": {"name": "wb"}, "trainer": {"total_steps": 3}}))
    log_steps(exp, [1, 2], eval_at=2)
    assert follow(exp).disabled == {}
    run_id = json.loads((exp.root / "trackers" / "wandb.json").read_text())["id"]
    (first,) = offline_runs(exp)
    assert first.name.endswith(run_id)
    log_file = first / f"run-{run_id}.wandb"
    assert history(log_file) == [{"step": 1, "loss": 0.5, "n_seqs": 8}, {"step": 2, "loss": 0.25, "n_seqs": 8},
                                 {"step": 2, "eval_accuracy": 0.5, "eval_se": 0.1, "eval_n": 25}]
    run = run_record(log_file)
    assert (run.run_id, run.project, run.display_name) == (run_id, "tandem", "wb")
    assert config(log_file) == {"experiment": {"name": "wb"}, "trainer": {"total_steps": 3}}

    log_steps(exp, [3])                     # the trainer is resumed and goes on
    time.sleep(1.1)   # W&B names a run's directory by the second it started in
    assert follow(exp).disabled == {}
    runs = offline_runs(exp)
    assert len(runs) == 2 and all(p.name.endswith(run_id) for p in runs)
    (second,) = [p for p in runs if p != first]
    assert history(second / f"run-{run_id}.wandb") == [{"step": 3, "loss": 0.5 / 3, "n_seqs": 8}]
    out, err = capfd.readouterr()
    assert "wandb" not in (out + err).lower(), out + err


def test_online_without_a_key_turns_the_sink_off_without_prompting(exp, no_wandb_account):
    log_steps(exp, [1])
    follower = follow(exp, mode="online")
    assert "WANDB_API_KEY" in follower.disabled["wandb"]
    assert not (exp.root / "wandb").exists()


def test_samples_become_a_table_in_the_offline_run(exp, no_wandb_account):
    """The trainer's `samples` records (trainer/samples.py) are W&B Tables, one per step."""
    row = {"group_id": "0-3", "sample_idx": 1, "prompt": "What is 2+2?", "response": "\\boxed{4}", "reward": 5.0,
           "version_min": 2, "version_max": 3}
    MetricsWriter(exp, "trainer").log(event="samples", step=4, samples=[row, {**row, "reward": -5.0}])
    assert follow(exp).disabled == {}
    (run,) = offline_runs(exp)
    run_id = json.loads((exp.root / "trackers" / "wandb.json").read_text())["id"]
    (logged,) = history(run / f"run-{run_id}.wandb")
    # W&B stores a table as a file of the run, which the row names (flattened: samples/<field>)
    assert logged["step"] == 4 and logged["samples/_type"] == "table-file" and logged["samples/nrows"] == 2
    table = json.loads((run / "files" / logged["samples/path"]).read_text())
    assert table["columns"] == ["step", "group", "reward", "version", "prompt", "response"]
    assert table["data"] == [[4, "0-3/1", 5.0, "v2-v3", "What is 2+2?", "\\boxed{4}"],
                             [4, "0-3/1", -5.0, "v2-v3", "What is 2+2?", "\\boxed{4}"]]
