"""The loop's global step on a tiny Qwen3-MoE with the Megatron backend, in-process: the step's
record carries the routing metrics the backend counted (each layer's expert load and dropped
assignments), and a torch-backend step, with no such counts, carries none (integration: the loop
binds its ZeroMQ trajectory endpoint on a real TCP socket)."""
from __future__ import annotations

from types import SimpleNamespace

import megatron_moe_case as mm
import pytest
import torch.distributed as dist

from tandem.trainer.batch import StepBatch
from tandem.trainer.buffer import Group
from tandem.trainer.config import TrainerConfig
from tandem.trainer.loop import Trainer
from tandem.trainer.megatron.config import MegatronConfig

pytestmark = pytest.mark.timeout(240)


def _groups(traj) -> list[Group]:
    return [Group(f"g{g}", 0, g, [traj(f"g{g}", k, group_size=2, reward=float((g + k) % 2) * 10 - 5,
                                       seed=10 * g + k, out_len=4 + (3 * g + k) % 7, prompt_len=3 + g, vocab=61)
                                  for k in range(2)])
            for g in range(4)]


def _step(exp, model_dir, traj, **trainer_kw) -> dict:
    t = TrainerConfig(temperature=1.0, max_staleness=0, groups_per_step=4, **trainer_kw)
    t.optim.lr = 1e-2
    cfg = SimpleNamespace(trainer=t, experiment=SimpleNamespace(model=str(model_dir), seed=0),
                          gen=SimpleNamespace(num_servers=1))
    made_group = not dist.is_initialized()
    trainer = Trainer(cfg, exp)
    try:
        return trainer.train_step(StepBatch.from_groups(_groups(traj)))
    finally:
        trainer.close()
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


def test_the_step_record_carries_the_routing_metrics(exp, tmp_path, traj):
    model = mm.make_moe_dir(tmp_path / "moe")
    rec = _step(exp, model, traj, backend="megatron", max_tokens_per_mb=40,
                megatron=MegatronConfig(params_dtype="float32", moe_capacity_factor=0.5))
    assert rec["micro_batches"] > 1
    for layer in range(2):
        assert 1.0 <= rec[f"moe_l{layer}_load_max"] <= mm.EXPERTS
        assert 0.0 < rec[f"moe_l{layer}_dropped"] < 1.0   # a capacity of half the even share drops some
    assert rec["moe_load_max"] == max(rec["moe_l0_load_max"], rec["moe_l1_load_max"])
    assert rec["moe_dropped_fraction"] == pytest.approx((rec["moe_l0_dropped"] + rec["moe_l1_dropped"]) / 2)
    torch_rec = _step(exp, model, traj, backend="torch")
    assert not any(k.startswith("moe_") for k in torch_rec)
