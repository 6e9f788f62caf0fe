"""The learning-rate schedule (trainer/lr_schedule.py): its values at chosen updates, worked by hand;
`constant` is the warm-up every earlier run had, number for number; both backends report the
schedule's rate for each applied update; and a backend restored from a checkpoint continues it."""
from __future__ import annotations

import dataclasses
import math

import megatron_case as mc
import pytest

from tandem.trainer.config import OptimConfig, TrainerConfig
from tandem.trainer.lr_schedule import decay_updates, lr_factor
from tandem.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(240)


def _optim(schedule="cosine", warm=2, floor=0.1, decay=0, lr=1.0) -> OptimConfig:
    return OptimConfig(lr=lr, warmup_steps=warm, schedule=schedule, min_lr_ratio=floor, decay_steps=decay)


@pytest.mark.parametrize("schedule, update, want", [
    # warm-up (W = 2): (k + 1) / W whatever the schedule
    ("cosine", 0, 0.5), ("linear", 0, 0.5), ("constant", 0, 0.5), ("cosine", 1, 1.0),
    # the first update after the warm-up is the full rate (p = 0), T = 10, floor 0.1
    ("cosine", 2, 1.0), ("linear", 2, 1.0),
    # p = (4 - 2) / 8 = 1/4: linear 0.1 + 0.9 * 3/4; cosine 0.1 + 0.9 * (1 + cos(pi/4)) / 2
    ("linear", 4, 0.775), ("cosine", 4, 0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2),
    # p = 1/2: both halfway, 0.55
    ("linear", 6, 0.55), ("cosine", 6, 0.55),
    # p = 1 at update T, held at the floor afterwards
    ("linear", 10, 0.1), ("cosine", 10, 0.1), ("cosine", 25, 0.1),
    ("constant", 7, 1.0),
])
def test_schedule_values_at_chosen_updates(schedule, update, want):
    o = _optim(schedule, floor=0.1 if schedule != "constant" else 0.0)
    assert lr_factor(o, update, 10) == pytest.approx(want, rel=1e-12)


def test_no_warmup_starts_the_decay_at_the_first_update():
    o = _optim("linear", warm=0, floor=0.0)
    assert [lr_factor(o, k, 4) for k in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_constant_is_the_warmup_every_earlier_run_had_bit_for_bit():
    for warm in (0, 1, 3, 20):
        o = _optim("constant", warm=warm, floor=0.0)
        for k in range(50):
            assert lr_factor(o, k, 7) == min(1.0, (k + 1) / max(1, warm))


def test_the_decay_spans_the_runs_updates_unless_decay_steps_says():
    t = TrainerConfig(total_steps=30, groups_per_step=4, ppo_n_minibatches=4)
    assert decay_updates(t) == 120
    t.optim.decay_steps = 50
    assert decay_updates(t) == 50


@pytest.mark.parametrize("optim, key, words", [
    (dict(schedule="step"), "optim.schedule", "constant, linear, cosine"),
    (dict(min_lr_ratio=0.1), "optim.min_lr_ratio", "no effect"),
    (dict(schedule="cosine", min_lr_ratio=1.5), "optim.min_lr_ratio", "[0, 1]"),
    (dict(schedule="cosine", warmup_steps=10, decay_steps=10), "optim.decay_steps", "larger than"),
    (dict(decay_steps=100), "optim.decay_steps", "no effect"),
])
def test_schedule_settings_that_cannot_work_are_refused(optim, key, words):
    problems = dict(TrainerConfig(temperature=1.0, max_staleness=0, optim=OptimConfig(**optim)).problems())
    assert key in problems and words in problems[key]


def _cfg(backend: str) -> TrainerConfig:
    c = TrainerConfig(backend=backend, temperature=1.0, max_staleness=0, total_steps=4, ppo_n_minibatches=2,
                      optim=_optim("cosine", warm=2, floor=0.2, lr=0.01))
    if backend == "megatron":
        c.megatron = dataclasses.replace(mc.trainer_cfg().megatron, params_dtype="float32")
    return c


def _updates(be, n: int) -> list[float]:
    mbs = mc.micro_batches(seed=2)
    out = []
    for _ in range(n):
        r = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
        assert r.applied
        out.append(r.lr)
    return out


def _megatron(model_dir):
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend
    created = not dist.is_initialized()
    be = MegatronBackend(_cfg("megatron"), model_dir, seed=0)

    def close():
        be.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return be, close


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_each_backend_runs_the_schedule_and_a_restored_one_continues_it(backend, tmp_path):
    """8 updates of a cosine decay over total_steps x ppo_n_minibatches = 8: 3 before a checkpoint
    (state_dict), 5 after it in a fresh backend, against 8 uninterrupted; both equal lr x factor."""
    model_dir = mc.make_model_dir(tmp_path / "m", tied=False)
    want = [0.01 * lr_factor(_cfg(backend).optim, k, 8) for k in range(8)]
    assert want[0] == 0.005 and want[-1] < want[3] < want[2] == 0.01   # warm-up, then decay
    if backend == "torch":
        first = TorchBackend(_cfg("torch"), model_dir, seed=0)
        before = _updates(first, 3)
        state = first.state_dict()
        again = TorchBackend(_cfg("torch"), model_dir, seed=0)
        again.load_state_dict(state)
        after = _updates(again, 5)
    else:
        first, close = _megatron(model_dir)
        try:
            before = _updates(first, 3)
            state = first.state_dict()
        finally:
            close()
        again, close = _megatron(model_dir)
        try:
            again.load_state_dict(state)
            after = _updates(again, 5)
        finally:
            close()
    assert before + after == pytest.approx(want, rel=1e-12)
