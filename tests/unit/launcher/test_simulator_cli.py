"""`tandem simulate` in-process, calibration from a metrics file, and the honesty of the hardware
tables (every datasheet number cites its source). `tandem plan --suggest` and sweeps (which
fan out over worker processes) are in tests/integration/launcher/test_simulator_sweep.py.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from config_cases import SMALL_SIMULATION

from tandem.launcher.cli import main
from tandem.launcher.config import ConfigError, load_config
from tandem.launcher.simulate.calibrate import calibrate
from tandem.launcher.simulate.hardware import HARDWARE_DIR, load_gpu
from tandem.launcher.simulate.scenario import simulate
from tandem.launcher.simulate.workload import read_output_lengths, sample_lengths


@pytest.fixture
def small(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text(SMALL_SIMULATION)
    return f


def test_simulate_prints_predictions_and_writes_json(small, tmp_path, capsys):
    out = tmp_path / "pred.json"
    assert main(["simulate", str(small), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("training steps / hour", "trajectories / s", "generation pool busy", "trainer pool busy",
                "staleness (step - admit version)"):
        assert row in text
    pred = json.loads(out.read_text())
    assert pred["steps_per_hour"] > 0 and 0 < pred["gen_utilization"] <= 1


def test_bad_sweep_keys_are_clear_errors(small, capsys):
    assert main(["simulate", str(small), "--sweep", "nodes=1,2"]) == 2
    assert "unknown key 'nodes'" in capsys.readouterr().err


def _synthetic_metrics(path, d0=0.02, d1=0.001, t0=2.0, t1=1e-4):
    """Records as the roles will log them, generated from a known linear law."""
    recs = []
    for n in (1, 4, 16, 64):
        recs.append({"role": "gen", "gen_running": n, "gen_tokens_per_s": n / (d0 + d1 * n)})
    for tokens in (10_000, 40_000, 90_000):
        recs.append({"role": "trainer", "train_tokens": tokens, "train_step_s": t0 + t1 * tokens,
                     "train_world_size": 2, "weight_publish_s": 1.5})
    recs.append({"role": "controller", "weight_load_s": 0.5})
    recs += [{"role": "rollout", "output_tokens": int(x)} for x in (100, 200)]
    recs.append({"role": "rollout", "event": "group", "output_tokens": [300, 400]})  # a worker's group record
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut by a cra")


def test_calibration_recovers_a_known_cost_law(tmp_path):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    cal = calibrate(tmp_path)
    assert (cal.d0, cal.d1, cal.t0, cal.t1) == pytest.approx((0.02, 0.001, 2.0, 1e-4), rel=1e-6)
    assert (cal.publish_s, cal.load_s, cal.train_world) == (1.5, 0.5, 2)
    assert any("gen_context_tokens" in n for n in cal.notes)


def test_calibration_from_server_windows_recovers_decode_prefill_and_request_costs(tmp_path):
    # Windows as the embedded server logs them (rollout/server/window.py), from a known law:
    # decode step = 0.004 + 0.0002 n + 1e-6 ctx; prefill call = 0.003 + 5e-5 tokens;
    # 0.001 s of request handling per request.
    recs = []
    for n, ctx, steps, calls, tokens, reqs in [(8, 400, 100, 10, 300, 40), (32, 2000, 80, 30, 2400, 90),
                                               (64, 3000, 50, 5, 900, 20), (100, 9000, 60, 40, 1200, 300)]:
        decode = steps * (0.004 + 0.0002 * n + 1e-6 * ctx)
        prefill = calls * 0.003 + 5e-5 * tokens
        recs.append({"role": "gen", "event": "gen_window", "window_s": 5.0, "gen_decode_s": decode,
                     "gen_steps": steps, "gen_running": n, "gen_context_tokens": ctx, "gen_prefill_s": prefill,
                     "gen_prefills": calls, "gen_prefill_tokens": tokens, "gen_requests": reqs,
                     "gen_overhead_s": 0.001 * reqs, "gen_idle_s": 5.0 - decode - prefill - 0.001 * reqs})
    recs.append({"role": "gen", "event": "gen_pause", "gen_paused_s": 0.02})
    recs.append({"role": "gen", "event": "weight_load", "weight_load_s": 0.005})
    recs.append({"role": "trainer", "train_tokens": 5000, "train_step_s": 1.0, "checkpoint_s": 0.1})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    cal = calibrate(tmp_path)
    assert (cal.d0, cal.d1, cal.d2) == pytest.approx((0.004, 0.0002, 1e-6), rel=1e-6)
    assert (cal.prefill_per_request, cal.prefill_per_token) == pytest.approx((0.003, 5e-5), rel=1e-6)
    assert cal.request_s == pytest.approx(0.001)
    # A server stands still from pause to continue, not just while it loads.
    assert (cal.load_s, cal.checkpoint_s) == (0.02, 0.1)


@pytest.mark.parametrize("tokens_per_call, per_token, want_token", [
    (12, 5e-5, 0.0),                             # a call cheaper than a forward pass: all per call
    (500, 5e-5, (0.003 + 5e-5 * 500 - 0.0042) / 500),  # one forward pass per call, the rest per token
    (12, 5e-4, 0.0002)])                         # a token no dearer than a decode row (d1)
def test_prefills_of_one_length_are_priced_per_call_up_to_one_forward_pass(tmp_path, tokens_per_call, per_token,
                                                                           want_token):
    """A synchronous run prefills only its prompts, all of about one length: calls and tokens move
    together and no fit can split them (the split it made at random priced a 96-token re-prefill
    about 8x what it costs). The calibration keeps each call's mean cost, priced per call up to one
    forward pass's fixed part (a decode step's first row: d0 + d1 = 0.0042 s here), the rest per
    token, but a token at most a decode row's cost (d1 = 0.0002 s)."""
    recs = []
    for n, steps, calls in [(8, 100, 10), (32, 80, 30), (64, 50, 5), (100, 60, 40)]:
        decode = steps * (0.004 + 0.0002 * n)
        recs.append({"role": "gen", "event": "gen_window", "window_s": 5.0, "gen_decode_s": decode,
                     "gen_steps": steps, "gen_running": n, "gen_context_tokens": 0,
                     "gen_prefill_s": calls * (0.003 + per_token * tokens_per_call), "gen_prefills": calls,
                     "gen_prefill_tokens": calls * tokens_per_call})
    recs.append({"role": "trainer", "train_tokens": 5000, "train_step_s": 1.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    cal = calibrate(tmp_path)
    assert cal.prefill_per_token == pytest.approx(want_token, rel=1e-6, abs=1e-12)
    mean_call = 0.003 + per_token * tokens_per_call   # what the run measured, kept
    assert cal.prefill_per_request + cal.prefill_per_token * tokens_per_call == pytest.approx(mean_call, rel=1e-6)
    assert any(f"all of about {tokens_per_call} tokens" in n for n in cal.notes)


def test_calibrated_simulation_uses_the_fitted_costs(small, tmp_path, capsys):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    cfg = load_config(small)
    sc, r = simulate(cfg, calibrate(tmp_path))
    # Trainer fitted on 2 ranks; the plan gives it 2 GPUs, so the fit applies unscaled.
    assert sc.layout.train_gpus == 2
    assert sc.costs.train_step_s(50_000, 0) == pytest.approx(2.0 + 5.0)
    assert sc.costs.decode_fixed[10] == pytest.approx(0.02 + 0.01)
    assert r.steps_per_hour > 0
    assert main(["simulate", str(small), "--calibrate", str(tmp_path)]) == 0
    assert "calibrated from" in capsys.readouterr().out


def test_the_runs_grading_latency_is_simulated_unless_the_config_sets_one(small, tmp_path):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    assert calibrate(tmp_path).grade_s is None   # not logged: simulate.reward_s (0) as before
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "\n" + "".join(   # the median, not the mean a straggler pulls up
        json.dumps({"role": "rollout", "event": "group", "output_tokens": [300, 400], "grade_s": grade}) + "\n"
        for grade in (0.03, 0.05, 0.9)))
    fit = calibrate(tmp_path)
    assert fit.grade_s == pytest.approx(0.05)
    assert "grade_s" in fit.provenance["grading latency (reward_s)"]
    measured, _ = simulate(load_config(small), fit)
    assert measured.setup.reward_s == pytest.approx(0.05) and any("50 ms per group" in n for n in measured.notes)
    chosen, _ = simulate(load_config(small, ["simulate.reward_s=2.0"]), fit)
    assert chosen.setup.reward_s == 2.0


def test_embedded_servers_are_simulated_only_from_a_calibration(small, tmp_path, capsys):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    cfg = load_config(small, ["gen.backend=embedded", "gen.num_servers=3"])
    with pytest.raises(ConfigError, match="--calibrate EXP_DIR"):
        simulate(cfg)
    sc, r = simulate(cfg, calibrate(tmp_path))
    assert sc.plan is None and sc.setup.num_servers == 3 and sc.layout.train_gpus == 2
    assert r.steps_per_hour > 0
    assert main(["simulate", str(small), "gen.backend=embedded", "--calibrate", str(tmp_path)]) == 0
    assert "embedded CPU servers" in capsys.readouterr().out


def test_chunks_on_embedded_servers_are_prefilled_in_full(small, tmp_path):
    """The embedded server has no prefix cache: simulate.chunk_prefix_cached (SGLang's radix
    cache, default true) does not apply to it, and the report says so."""
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    fit = calibrate(tmp_path)
    chunks = ["rollout.new_tokens_per_chunk=64"]
    embedded, _ = simulate(load_config(small, ["gen.backend=embedded", *chunks]), fit)
    sglang, _ = simulate(load_config(small, chunks), fit)
    assert not embedded.setup.chunk_prefix_cached and sglang.setup.chunk_prefix_cached
    assert any("no prefix cache" in n for n in embedded.notes)


def test_calibration_without_the_needed_metrics_says_which(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"role": "trainer", "loss": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="no generation-server window"):
        calibrate(tmp_path)


def test_empirical_lengths_come_from_a_runs_records(tmp_path):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    assert sorted(read_output_lengths(tmp_path).tolist()) == [100, 200, 300, 400]
    x = sample_lengths(f"empirical:{tmp_path}", 1000, median=1, sigma=0, max_new_tokens=250, seed=0)
    assert set(np.unique(x).tolist()) == {100, 200, 250}


def _comment_above(lines: list[str], i: int) -> str:
    """The nearest comment block above line i, skipping sibling keys that share it."""
    j = i - 1
    while j >= 0 and not lines[j].strip().startswith("#"):
        j -= 1
    block = []
    while j >= 0 and lines[j].strip().startswith("#"):
        block.append(lines[j])
        j -= 1
    return " ".join(block)


def test_every_datasheet_number_cites_a_source_and_assumptions_say_so():
    for f in sorted(HARDWARE_DIR.glob("*.yaml")):
        if f.stem == "models":
            continue
        load_gpu(f.stem)
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*\w+:\s*[0-9.]+(e-?\d+)?\s*$", line) and not line.startswith("gpus_per_node"):
                text = _comment_above(lines, i)
                assert "Source" in text or "Assumption" in text, f"{f.name}:{i + 1}: {line.strip()}"


def test_model_shape_from_the_experiments_config_json(tmp_path):
    from tandem.launcher.simulate.hardware import load_model_shape
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "hidden_size": 1536, "num_attention_heads": 12,
        "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
        "tie_word_embeddings": False}))
    named = load_model_shape("R1-Distill-Qwen-1.5B")
    assert load_model_shape("", str(tmp_path)) == dataclasses.replace(named, name=tmp_path.name)
    with pytest.raises(ConfigError, match="set simulate.model_size"):
        load_model_shape("", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="known: R1-Distill-Qwen-1.5B"):
        load_model_shape("GPT-5")
