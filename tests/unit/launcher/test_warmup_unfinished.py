"""A warm-up stopped before its steps is never cached as done, and the next call continues it to
the model an uninterrupted warm-up makes (issue 63: a time cap cut `make train-math`'s warm-up at
step 376 of 1,000, cached it, and every later run started RL from it).

A busy machine is played by a clock that advances `1000 s` per reading (the warm-up's only use
of time), so nothing here depends on how fast this machine is. The real signals and the command's
exit status are tested with a real `tandem sft` process in
tests/integration/e2e/test_warmup.py."""
from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from tandem.launcher.warmup import cached, partial_path, stop_on_signals, warm_up
from tandem.trainer.sft import SFTSettings, read_partial

STEPS = 4
BATCH = 4   # rows per step (the command's 64 would make this file the unit tier's slowest)


class SlowClock:
    """Every reading is `per_call` seconds after the previous one; `die_at` readings raise, as a
    SIGKILL would end the process there."""

    def __init__(self, per_call: float = 1000.0, die_at: int | None = None):
        self.t, self.per_call, self.calls, self.die_at = 0.0, per_call, 0, die_at

    def __call__(self) -> float:
        self.calls += 1
        if self.die_at is not None and self.calls >= self.die_at:
            raise SystemExit("killed")
        self.t += self.per_call
        return self.t


def weights(out):
    return load_file(out / "model.safetensors")


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A warm-up of STEPS steps on a machine where every step takes `1000 s`: without a cap it
    runs them all (the default has none) and is cached."""
    out = tmp_path_factory.mktemp("ref") / "warm"
    summary = warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH, clock=SlowClock())
    assert summary["complete"] and summary["steps"] == STEPS
    return weights(out)


def test_a_time_capped_warm_up_is_not_cached_and_the_next_run_finishes_it(tmp_path, reference, capsys):
    out = tmp_path / "warm"
    stopped = warm_up("math", out, STEPS, 2500.0, seed=0, eval_n=0, batch_size=BATCH, clock=SlowClock())
    said = capsys.readouterr().out
    assert not stopped["complete"] and 0 < stopped["steps"] < STEPS
    assert not out.exists(), "a warm-up stopped by its cap wrote the model"
    assert "not cached as done" in said and f"stopped at step {stopped['steps']} of {STEPS}" in said
    assert "time cap" in said and str(partial_path(out)) in said
    assert cached(out, "math", STEPS, 0) == (None, "")

    done = warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH, clock=SlowClock())
    said = capsys.readouterr().out
    assert f"continuing the unfinished warm-up from step {stopped['steps']} of {STEPS}" in said
    assert done["complete"] and done["steps"] == STEPS and json.loads((out / "sft.json").read_text())["complete"]
    assert same_weights(weights(out), reference), "continued warm-up differs from an uninterrupted one"
    assert not partial_path(out).exists()
    warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH)
    assert "using cached warm-up model" in capsys.readouterr().out


def test_a_killed_warm_up_continues_from_its_last_save(tmp_path, reference, capsys):
    out = tmp_path / "warm"
    # Saves after every step, and dies partway (the clock's 6th reading: before step 3).
    with pytest.raises(SystemExit):
        warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH, clock=SlowClock(die_at=6), checkpoint_every=1)
    assert not out.exists()
    identity = {"task": "math", **SFTSettings(max_steps=STEPS, seed=0, batch_size=BATCH).identity()}
    state, why = read_partial(partial_path(out), identity)
    assert why == "" and 0 < state["step"] < STEPS
    capsys.readouterr()
    warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH)
    assert f"continuing the unfinished warm-up from step {state['step']}" in capsys.readouterr().out
    assert same_weights(weights(out), reference)


def test_a_stop_request_saves_and_a_warm_up_of_other_settings_starts_over(tmp_path, capsys):
    out = tmp_path / "warm"

    class StopAfterFirstStep(SlowClock):
        def __call__(self):
            if self.calls == 2:   # t0, before step 1, after it: Ctrl-C arrives during step 1
                stop.set()
            return super().__call__()

    with stop_on_signals() as stop:
        stopped = warm_up("math", out, STEPS, None, seed=0, eval_n=0, batch_size=BATCH, stop=stop, clock=StopAfterFirstStep())
    assert not stopped["complete"] and stopped["steps"] == 1 and stopped["stopped_by"] == "a stop request"
    assert not out.exists() and partial_path(out).exists()
    capsys.readouterr()
    warm_up("math", out, STEPS + 1, None, seed=0, eval_n=0, batch_size=BATCH)   # other steps: another model
    said = capsys.readouterr().out
    assert f"unfinished warm-up with other settings: max_steps {STEPS} (now {STEPS + 1}); starting over" in said
    assert json.loads((out / "sft.json").read_text())["steps"] == STEPS + 1


def test_a_cached_warm_up_cut_short_by_an_earlier_version_is_not_used(tmp_path):
    """The marker earlier versions wrote for a warm-up their time cap stopped: steps < max_steps."""
    out = tmp_path / "warm"
    out.mkdir()
    (out / "sft.json").write_text(json.dumps({"task": "math", "steps": 376, "greedy_accuracy": 0.095,
                                              "settings": {"max_steps": 1000, "seed": 0, "seconds": 1800.0}}))
    done, why = cached(out, "math", 1000, 0)
    assert done is None and why == f"{out} holds a warm-up stopped at step 376 of 1000 (greedy accuracy 0.095): " \
                                    f"not using it"


def test_ctrl_c_asks_to_stop_and_a_second_one_stops_at_once(capsys):
    before = signal.getsignal(signal.SIGINT)   # Python's default, or SIG_IGN in a shell's background job
    with stop_on_signals() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set() and stop.signum == signal.SIGINT
        assert "stopping the warm-up after this step" in capsys.readouterr().out
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before   # what was there is back


def test_a_warm_up_of_the_moe_twin_is_its_own(tmp_path, capsys):
    """`--arch qwen3_moe` warms up the tiny Qwen3-MoE, cached as such: a dense warm-up of the same
    task, steps and seed in its folder is not taken for it, nor it for a dense one."""
    out = tmp_path / "warm"
    warm_up("math", out, 1, None, seed=0, eval_n=0, batch_size=BATCH)
    assert cached(out, "math", 1, 0)[0] is not None and cached(out, "math", 1, 0, "qwen3_moe") == (None, "")
    capsys.readouterr()
    done = warm_up("math", out, 1, None, seed=0, eval_n=0, batch_size=BATCH, arch="qwen3_moe")
    assert "using cached" not in capsys.readouterr().out and done["arch"] == "qwen3_moe"
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert cached(out, "math", 1, 0, "qwen3_moe")[0] is not None and cached(out, "math", 1, 0) == (None, "")
