"""Routed experts as trajectory data (rollout routing replay): compact on the wire (uint8, uint16
past 256 experts), unchanged through the write-ahead log, refused by the buffer when their shape
does not fit the sample or the model, or when replay is on and a sample has none; the config
check refuses them on a dense model; the worker and trainer read the
shape from config.json (a row per layer, as SGLang; dense layers refused)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tandem.services.protocol.trajectory import compact_experts, dense_layers, routing_shape
from tandem.trainer.buffer import ReplayBuffer, validate
from tandem.trainer.config import TrainerConfig
from tandem.trainer.model_fit import model_fit_problems
from tandem.trainer.wal import TrajectoryLog, replay

SHAPE = (2, 2, 4)     # layers, top_k, experts


def _with_experts(traj, rows=None, layers=2, top_k=2, high=4, seed=0):
    t = traj("g", 0, prompt_len=5, out_len=4)
    n = len(t.prompt_ids) + len(t.output_ids) - 1 if rows is None else rows
    t.routed_experts = compact_experts(np.random.default_rng(seed).integers(0, high, (n, layers, top_k)))
    return t


def test_compact_dtype_and_the_wal_round_trip(traj, tmp_path):
    assert compact_experts(np.array([[[0, 255]]])).dtype == np.uint8
    assert compact_experts(np.array([[[0, 300]]])).dtype == np.uint16
    with pytest.raises(ValueError):
        compact_experts(np.array([[[-1, 0]]]))
    small, big = _with_experts(traj), _with_experts(traj, high=1000, seed=1)
    log = TrajectoryLog(tmp_path / "wal.bin")
    for t in (small, big):
        log.append(t)
    log.close()
    back = list(replay(tmp_path / "wal.bin"))
    for was, got in zip((small, big), back, strict=True):
        assert got.routed_experts.dtype == was.routed_experts.dtype
        assert np.array_equal(got.routed_experts, was.routed_experts)
    assert back[0].routed_experts.nbytes == 8 * 2 * 2      # one byte per expert id


def test_validate_checks_the_shape_against_the_sample_and_the_model(traj):
    assert validate(_with_experts(traj), routing=SHAPE) is None
    assert validate(_with_experts(traj)) is None                              # replay off: accepted
    assert validate(traj("g", 0), routing=None) is None
    assert "has no routed_experts" in validate(traj("g", 0), routing=SHAPE)
    assert "expected [8, layers, top_k]" in validate(_with_experts(traj, rows=9), routing=SHAPE)
    assert "expected [8, layers, top_k]" in validate(_with_experts(traj, rows=9))
    assert "3 layers x top-2; the model routes 2 x top-2" in validate(_with_experts(traj, layers=3), routing=SHAPE)
    assert "the model has 4" in validate(_with_experts(traj, high=9), routing=SHAPE)


def test_the_buffer_refuses_a_group_without_experts_when_the_run_records_them(traj):
    buf = ReplayBuffer(routing=SHAPE)
    assert buf.add(_with_experts(traj)) is True
    assert buf.add(traj("g", 1)) is False
    assert "no routed_experts" in buf.refused["g"]


def test_routing_shape_has_a_row_per_layer_as_sglang():
    cfg = {"num_hidden_layers": 6, "num_experts": 128, "num_experts_per_tok": 8}
    assert routing_shape(cfg) == (6, 8, 128) and dense_layers(cfg) == []
    assert dense_layers({**cfg, "mlp_only_layers": [0]}) == [0]
    assert dense_layers({**cfg, "decoder_sparse_step": 2}) == [0, 2, 4]
    assert routing_shape({"num_hidden_layers": 2, "num_experts_per_tok": 2}) is None
    assert routing_shape({"text_config": cfg}) == (6, 8, 128)


def test_the_config_check_refuses_replay_on_a_dense_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))
    on = dataclasses.replace(TrainerConfig(), routing_replay=True)
    assert any("has no experts to route" in why for _, why in model_fit_problems(on, str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                                                      "num_experts": 4, "num_experts_per_tok": 2}))
    assert model_fit_problems(on, str(tmp_path)) == []
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                                                      "num_experts": 4, "num_experts_per_tok": 2,
                                                      "mlp_only_layers": [1]}))
    assert "has dense layers [1]" in dict(model_fit_problems(on, str(tmp_path)))["trainer.routing_replay"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                                                      "num_experts": 4, "num_experts_per_tok": 2}))
    mg = dataclasses.replace(on, backend="megatron")
    assert model_fit_problems(mg, str(tmp_path)) == []
    measure = dataclasses.replace(mg, routing_replay=False, routing_agreement=True)
    assert measure.records_routing and model_fit_problems(measure, str(tmp_path)) == []


def test_the_step_batch_lays_the_experts_along_the_tokens(traj):
    from types import SimpleNamespace

    from tandem.trainer.batch import StepBatch, sequence_tensors
    with_e = _with_experts(traj)
    batch = StepBatch.from_groups([SimpleNamespace(group_id="g", admit_version=0, samples=[with_e])])
    _, fields = sequence_tensors(batch, 0, 1.0)
    rows = fields["routed_experts"]
    assert rows.shape == (9, 2, 2) and (rows[-1] == -1).all()       # the last token was never fed
    assert np.array_equal(rows[:-1], with_e.routed_experts)
    mixed = StepBatch.from_groups([SimpleNamespace(group_id="g", admit_version=0, samples=[with_e, traj("g", 1)])])
    assert mixed.routed_experts == [None, None]                      # all or none: packs stay uniform
    assert "routed_experts" not in sequence_tensors(mixed, 0, 1.0)[1]


def test_tandem_config_check_refuses_replay_on_a_dense_model_not_with_an_agent(tmp_path):
    """The launch check, from the experiment file's keys (a model directory as far as the check
    reads one: model_dirs.py). An agent's episodes carry their completions' experts joined
    (tests/unit/rollout/test_agent_routing.py), so replay with `rollout.agent` is launched."""
    from model_dirs import checked_model_dir

    from tandem.launcher.config import load_config
    from tandem.launcher.preflight import resource_problems

    moe = checked_model_dir(tmp_path / "moe")
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8,
                                                 "num_experts_per_tok": 2, "num_hidden_layers": 2}))
    dense = checked_model_dir(tmp_path / "dense")
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))

    def problems(model, *more):
        return dict(resource_problems(load_config(None, [f"experiment.model={model}", "experiment.name=x",
                                                         f"experiment.exp_dir={tmp_path / 'x'}",
                                                         "trainer.routing_replay=true", *more])))
    assert problems(moe) == {}
    assert "has no experts to route" in problems(dense)["trainer.routing_replay"]
    measured = dict(resource_problems(load_config(None, [f"experiment.model={dense}", "experiment.name=x",
                                                         f"experiment.exp_dir={tmp_path / 'x'}",
                                                         "trainer.routing_agreement=true"])))
    assert "has no experts to route" in measured["trainer.routing_agreement"]
    assert problems(moe, "rollout.agent=tandem.rollout.agents.calculator:solve") == {}
