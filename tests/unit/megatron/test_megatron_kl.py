"""The KL penalty on the Megatron backend is the torch backend's: the same batch and the same
weights give the same reference log-probs, KL term, loss and gradient norm on both (CPU, float32;
real megatron-core 0.16.1, one rank). Both run the loop's own code path: objective_step's
start_of_step fills `ref_logp` from `forward_ref_logprobs` (the backend's frozen copy of
experiment.model), and its loss function (trainer/loss.py) adds kl_coef x the k3 estimate."""
from __future__ import annotations

import copy
import dataclasses

import megatron_case as mc
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.trainer import objective_step as objective
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import OptimConfig, TrainerConfig
from tandem.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(240)
T = 0.9


def _cfg(backend: str) -> TrainerConfig:
    c = TrainerConfig(backend=backend, temperature=T, max_staleness=0, kl_coef=0.1, kl_estimator="k3",
                      optim=OptimConfig(lr=1e-3))
    c.megatron = dataclasses.replace(c.megatron, params_dtype="float32")
    return c


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(initial, trained): the reference is the initial model; the policy has moved away from it."""
    tmp = tmp_path_factory.mktemp("kl")
    initial = mc.make_model_dir(tmp / "initial", tied=False)
    trained = mc.make_model_dir(tmp / "trained", tied=False)
    gen = torch.Generator().manual_seed(7)
    state = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=gen)
             for k, v in load_file(initial / "model.safetensors").items()}
    save_file(state, str(trained / "model.safetensors"), metadata={"format": "pt"})
    return initial, trained


def _plan(traj):
    groups = [Group(f"g{g}", 0, g, [traj(f"g{g}", k, group_size=2, reward=float((g + k) % 2), seed=10 * g + k,
                                         out_len=3 + (g * 5 + k) % 7, prompt_len=2 + g, vocab=mc.VOCAB)
                                    for k in range(2)]) for g in range(3)]
    return plan_step(StepBatch.from_groups(groups), 1, 10_000, 1, 0, True, True)


def _step(be, plan, cfg) -> dict:
    """The loop's start of step and one update; the fields it filled and the update's report."""
    settings = objective.settings_from_config(cfg)
    objective.start_of_step(plan, be, T, settings)
    (mp,) = plan.minibatches
    result = be.train_step(mp.micro_batches, objective.make_loss_fn(settings, mp, 0, 1, 0), T)
    fields = {k: torch.cat([mb.fields[k] for mb in mp.micro_batches]) for k in ("ref_logp", "prox_logp", "loss_mask")}
    return {"result": result, **fields}


def test_same_batch_same_weights_same_kl_and_loss_on_both_backends(models, traj):
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    initial, trained = models
    plan = _plan(traj)
    policy = {k: v for k, v in load_file(trained / "model.safetensors").items()}
    torch_be = TorchBackend(_cfg("torch"), initial, seed=0)
    torch_be.model.load_state_dict(policy)          # the policy moved; the reference is `initial`
    on_torch = _step(torch_be, copy.deepcopy(plan), _cfg("torch"))

    created = not dist.is_initialized()
    mg = MegatronBackend(_cfg("megatron"), initial, seed=0)
    try:
        assert mg.reference is not None               # built with the policy, by every rank
        mg.load_hf(trained)                            # the policy only
        on_megatron = _step(mg, copy.deepcopy(plan), _cfg("megatron"))
    finally:
        mg.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()

    mask = on_torch["loss_mask"].bool()
    for k in ("ref_logp", "prox_logp"):
        torch.testing.assert_close(on_megatron[k], on_torch[k], rtol=0, atol=2e-5, msg=k)
    # the reference is the initial model, not the policy: the penalty has something to measure
    assert (on_torch["ref_logp"] - on_torch["prox_logp"])[mask].abs().max() > 1e-2
    # k3 over the valid tokens, by hand from the torch backend's fields (the first update runs at
    # the step's start parameters, so its log-probs are the proximal ones)
    d = (on_torch["ref_logp"] - on_torch["prox_logp"])[mask].double()
    kl_by_hand = float((d.exp() - 1 - d).sum())
    a, b = on_torch["result"], on_megatron["result"]
    assert a.stats["kl_sum"] == pytest.approx(kl_by_hand, rel=1e-5) and kl_by_hand > 1e-3
    assert b.stats["kl_sum"] == pytest.approx(a.stats["kl_sum"], rel=1e-4)
    for k in ("loss", "objective"):
        assert b.stats[k] == pytest.approx(a.stats[k], rel=1e-4, abs=1e-7), k
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)


def test_without_a_kl_penalty_no_reference_model_is_built(models):
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    created = not dist.is_initialized()
    cfg = dataclasses.replace(_cfg("megatron"), kl_coef=0.0)
    mg = MegatronBackend(cfg, models[0], seed=0)
    try:
        assert mg.reference is None
    finally:
        mg.close()
        if created and dist.is_initialized():
            dist.destroy_process_group()
