"""The tracking sinks' follower on a synthetic metrics.jsonl, in one process: what it forwards
(names, values, steps), what it leaves for later (a half-written line), resume from its saved
offset, a failing sink, and a TensorBoard event file read back. W&B starts a service process,
so its sink is tested in tests/integration/foundation/test_wandb_tracker.py.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math

import pytest
from config_cases import GOOD_EXPERIMENT

from tandem.launcher.config import ConfigError, load_config
from tandem.services.protocol import ExpDir, MetricsWriter
from tandem.services.protocol.tracker_sinks import TensorBoardSink
from tandem.services.protocol.trackers import TrackerFollower, WandbConfig, start_trackers, tracker_hints


class Recorder:
    """A sink that remembers every call."""

    def __init__(self, name="recorder", fail_in: str | None = None):
        self.name, self.fail_in = name, fail_in
        self.calls: list[tuple] = []

    def _call(self, method, *args):
        self.calls.append((method, *args))
        if method == self.fail_in:
            raise OSError(f"{self.name} broke in {method}")

    def open(self, config):
        self._call("open", config)

    def log(self, values, step, wall_time=None):
        self._call("log", values, step)

    def rewind(self, step):
        self._call("rewind", step)

    def samples(self, rows, step):
        self._call("samples", rows, step)

    def flush(self):
        self._call("flush")

    def close(self):
        self._call("close")

    def logged(self):
        return [(step, values) for method, *rest in self.calls if method == "log" for values, step in [rest]]


def step_record(writer: MetricsWriter, step: int, loss: float, **extra) -> None:
    writer.log(event="step", step=step, loss=loss, reward_mean=0.5 * step, n_seqs=8, too_long=0,
               staleness_hist={"0": 3, "1": 1}, group_ids=["g1", "g2"], ack_ok=True, method="disk", **extra)


def write_run(exp: ExpDir, steps=(1, 2), loss_per_step: float = 0.1) -> None:
    trainer, rollout = MetricsWriter(exp, "trainer"), MetricsWriter(exp, "rollout", 1)
    for s in steps:
        rollout.log(event="group", group_id=f"g{s}", correct=1.0, reward=5.0)
        step_record(trainer, s, loss=loss_per_step * s)
        trainer.log(event="checkpoint", step=s, checkpoint_s=0.2)   # not a step record
    rollout.log(event="eval", step=steps[-1], eval_accuracy=0.25, eval_se=0.05, eval_n=64, version_min=1,
                version_max=2, bogus=float("nan"))
    trainer.close()
    rollout.close()


STEP_VALUES = {"loss", "reward_mean", "n_seqs", "too_long"}   # the numeric, non-bool fields above


def test_forwards_step_and_eval_records_by_their_jsonl_names(exp):
    write_run(exp)
    rec = Recorder()
    follower = TrackerFollower(exp, [rec], config={"experiment": {"name": "x"}})
    follower.open()
    assert follower.poll() == 3
    logged = rec.logged()
    assert [s for s, _ in logged] == [1, 2, 2]
    assert set(logged[0][1]) == STEP_VALUES and logged[0][1]["loss"] == pytest.approx(0.1)
    assert logged[1][1]["reward_mean"] == 1.0 and logged[1][1]["n_seqs"] == 8
    assert logged[2][1] == {"eval_accuracy": 0.25, "eval_se": 0.05, "eval_n": 64, "version_min": 1, "version_max": 2}
    assert rec.calls[0] == ("open", {"experiment": {"name": "x"}}) and rec.calls[-1] == ("flush",)
    follower.close()
    assert rec.calls[-1] == ("close",)


def test_nan_and_infinite_values_are_left_out(exp):
    writer = MetricsWriter(exp, "trainer")
    step_record(writer, 1, loss=float("nan"), grad_norm=float("inf"), entropy=1.5)
    rec = Recorder()
    TrackerFollower(exp, [rec], config={}).poll()
    (step, values), = rec.logged()
    assert step == 1 and "loss" not in values and "grad_norm" not in values and values["entropy"] == 1.5
    assert all(math.isfinite(v) for v in values.values())


def test_a_half_written_line_waits_for_its_newline(exp):
    write_run(exp, steps=(1,))
    line = json.dumps({"time": 1.0, "role": "trainer", "rank": 0, "event": "step", "step": 2, "loss": 0.5}) + "\n"
    with open(exp.metrics, "ab") as f:
        f.write(line[:20].encode())
    rec = Recorder()
    follower = TrackerFollower(exp, [rec], config={})
    assert follower.poll() == 2
    assert follower.offset == exp.metrics.stat().st_size - 20
    with open(exp.metrics, "ab") as f:
        f.write(line[20:].encode())
    assert follower.poll() == 1
    assert rec.logged()[-1] == (2, {"loss": 0.5})
    assert follower.offset == exp.metrics.stat().st_size


def test_resume_continues_from_the_saved_offset_without_logging_twice(exp):
    write_run(exp, steps=(1, 2))
    first = Recorder()
    follower = TrackerFollower(exp, [first], config={})
    follower.poll()
    follower.close()
    saved = json.loads((exp.root / "trackers" / "offset.json").read_text())
    assert saved == {"offset": exp.metrics.stat().st_size, "last_step": 2}
    write_run(exp, steps=(3, 4))            # the trainer goes on (or is resumed) after that
    second = Recorder()
    resumed = TrackerFollower(exp, [second], config={})
    assert resumed.offset == saved["offset"]
    resumed.poll()
    assert [s for s, _ in first.logged()] == [1, 2, 2]
    assert [s for s, _ in second.logged()] == [3, 4, 4]
    assert not any(c[0] == "rewind" for c in second.calls)


def test_a_step_trained_again_after_resume_rewinds_the_sinks(exp):
    write_run(exp, steps=(1, 2, 3))
    TrackerFollower(exp, [Recorder()], config={}).poll()
    write_run(exp, steps=(3, 4))            # resumed from the checkpoint of step 2
    rec = Recorder()
    TrackerFollower(exp, [rec], config={}).poll()
    assert [c for c in rec.calls if c[0] in ("rewind", "log")][0] == ("rewind", 3)
    assert sum(c[0] == "rewind" for c in rec.calls) == 1


def test_a_failing_sink_is_disabled_and_the_others_go_on(exp, caplog):
    write_run(exp, steps=(1, 2))
    broken, healthy, never_opened = Recorder("broken", fail_in="log"), Recorder("healthy"), Recorder("x", fail_in="open")
    follower = TrackerFollower(exp, [broken, healthy, never_opened], config={})
    with caplog.at_level(logging.WARNING):
        follower.open()
        follower.poll()
        write_run(exp, steps=(3,))
        follower.poll()
        follower.close()
    assert [s for s, _ in healthy.logged()] == [1, 2, 2, 3, 3]
    assert len(broken.logged()) == 1 and broken.calls[-1] == ("close",)     # closed once, then left alone
    assert never_opened.logged() == [] and [c[0] for c in never_opened.calls] == ["open", "close"]
    assert set(follower.disabled) == {"broken", "x"} and "broke in log" in follower.disabled["broken"]
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert len(warnings) == 2 and all("off for the rest" in w for w in warnings)
    assert "tracker x failed (open" in warnings[0] and "tracker broken failed (log" in warnings[1]


def test_the_thread_forwards_until_stopped(exp):
    rec = Recorder()
    follower = TrackerFollower(exp, [rec], config={}, poll_s=0.05).start()
    write_run(exp, steps=(1, 2))
    assert follower.stop(timeout_s=10)
    assert [s for s, _ in rec.logged()] == [1, 2, 2]
    assert rec.calls[0][0] == "open" and rec.calls[-1] == ("close",)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="pip install 'tandem[trackers]'")
def test_tensorboard_event_file_holds_the_scalars(exp):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(exp, steps=(1, 2, 3))
    follower = TrackerFollower(exp, [TensorBoardSink(exp.root / "tb")], config={"experiment": {"name": "tb"}})
    follower.open()
    follower.poll()
    follower.close()
    write_run(exp, steps=(3, 4), loss_per_step=1.0)   # a resumed trainer trains step 3 again
    follower = TrackerFollower(exp, [TensorBoardSink(exp.root / "tb")], config={"experiment": {"name": "tb"}})
    follower.open()
    follower.poll()
    follower.close()

    acc = EventAccumulator(str(exp.root / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == STEP_VALUES | {"eval_accuracy", "eval_se", "eval_n", "version_min",
                                                         "version_max"}
    # Step 3 of the abandoned launch (loss 0.3, logged first) was dropped for the resumed one's
    # (3.0), and so was its evaluation at step 3; the resumed launch's at step 4 stays.
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("loss")] == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval_accuracy")] == [(4, 0.25)]
    assert any("config" in tag for tag in acc.Tags()["tensors"])


SAMPLE = {"group_id": "0-3", "sample_idx": 1, "prompt": "What is 2+2?", "response": "It is \\boxed{4}.\n| done",
          "reward": 5.0, "version_min": 2, "version_max": 3}


def test_sample_records_go_to_the_sinks_as_rows(exp):
    """The trainer's `samples` records (trainer/samples.py) reach a sink's `samples(rows, step)`."""
    write_run(exp, steps=(1,))
    MetricsWriter(exp, "trainer").log(event="samples", step=1, samples=[SAMPLE, {**SAMPLE, "version_max": 2}])
    MetricsWriter(exp, "rollout").log(event="samples", step=1, samples=[SAMPLE])   # not the trainer's
    rec = Recorder()
    TrackerFollower(exp, [rec], config={}).poll()
    assert [c for c in rec.calls if c[0] == "samples"] == [("samples", [
        [1, "0-3/1", 5.0, "v2-v3", "What is 2+2?", "It is \\boxed{4}.\n| done"],
        [1, "0-3/1", 5.0, "v2", "What is 2+2?", "It is \\boxed{4}.\n| done"]], 1)]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="pip install 'tandem[trackers]'")
def test_tensorboard_shows_the_samples_as_text_at_their_step(exp):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    MetricsWriter(exp, "trainer").log(event="samples", step=7, samples=[SAMPLE])
    follower = TrackerFollower(exp, [TensorBoardSink(exp.root / "tb")], config={})
    follower.open()
    follower.poll()
    follower.close()
    acc = EventAccumulator(str(exp.root / "tb"))
    acc.Reload()
    (event,) = acc.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 7 and "**0-3/1**: reward 5.0, v2-v3" in text
    assert "    What is 2+2?" in text and "    It is \\boxed{4}.\n    | done" in text   # code blocks, as written


def test_config_names_a_bad_tracker_and_a_missing_package(tmp_path, monkeypatch):
    path = tmp_path / "exp.yaml"
    path.write_text(GOOD_EXPERIMENT)
    with pytest.raises(ConfigError, match=r"experiment\.trackers\[1\]: unknown tracker 'tensorbord'"):
        load_config(path, ["experiment.trackers=[jsonl,tensorbord]"])
    with pytest.raises(ConfigError, match=r"experiment\.wandb\.mode: must be one of offline, online"):
        load_config(path, ["experiment.trackers=[wandb]", "experiment.wandb.mode=cloud"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"experiment\.trackers\[0\]: wandb is not installed: "
                                          r"pip install 'tandem\[trackers\]' \(offline: `make wheelhouse "
                                          r"EXTRAS=trackers`\), or leave wandb out of the list"):
        load_config(path, ["experiment.trackers=[wandb]"])
    assert load_config(path).experiment.trackers == ["jsonl"]


def test_only_jsonl_starts_nothing_and_hints_name_the_commands(exp):
    class Cfg:
        class experiment:  # noqa: N801
            trackers, wandb, name = ["jsonl"], WandbConfig(), "x"
    assert start_trackers(Cfg, exp) is None
    hints = tracker_hints(["jsonl", "tensorboard", "wandb"], WandbConfig(), exp.root)
    assert hints[0].startswith(f"tensorboard: tensorboard --logdir {exp.root / 'tb'}")
    assert hints[1] == f"wandb (offline): wandb sync {exp.root / 'wandb'}/offline-run-*"
    assert tracker_hints(["jsonl"], None, exp.root) == []
