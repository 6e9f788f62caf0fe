"""A mixture-of-experts model (Qwen3-MoE) on the torch backend, through transformers: it loads, its
packed forward gives the log-probs the Megatron backend gives for the same micro-batch (two
implementations of the router and experts agreeing), a training step moves the router and the
experts the tokens went to, and LoRA on it, which peft cannot apply to 3-D expert parameters, is
refused when the config is checked, as expert parallelism on a model without experts is."""
from __future__ import annotations

import megatron_case as mc
import megatron_moe_case as mm
import pytest
import torch

from tandem.trainer.config import TrainerConfig
from tandem.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return mm.make_moe_dir(tmp_path_factory.mktemp("qwen3moe"))


def _cfg(**kw) -> TrainerConfig:
    c = TrainerConfig(temperature=1.0, max_staleness=0, **kw)
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 0
    return c


def test_packed_forward_gives_the_megatron_backends_logprobs(moe_dir):
    mbs = mc.micro_batches(0)
    torch_be = TorchBackend(_cfg(), moe_dir, seed=0)
    got = torch.cat([torch_be.forward_logprobs(mb, 1.0).logp for mb in mbs])
    one_by_one = TorchBackend(_cfg(packed_forward=False), moe_dir, seed=0)
    torch.testing.assert_close(got, torch.cat([one_by_one.forward_logprobs(mb, 1.0).logp for mb in mbs]),
                               atol=1e-5, rtol=1e-5)
    gen = mc.in_process_backend(moe_dir, cfg=mm.moe_trainer_cfg())
    try:
        torch.testing.assert_close(got, mc.logps(next(gen), mbs), atol=2e-5, rtol=1e-5)
    finally:
        next(gen, None)


def test_a_training_step_moves_the_router_and_the_experts(moe_dir):
    be = TorchBackend(_cfg(), moe_dir, seed=0)
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    mbs = mc.micro_batches(0)
    r = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
    assert r.applied and r.grad_norm > 0
    moved = {n for n, p in be.model.named_parameters() if not torch.equal(p, before[n])}
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= moved
    assert {f"model.layers.{i}.mlp.experts.{k}" for i in range(2) for k in ("gate_up_proj", "down_proj")} <= moved


def test_lora_and_expert_parallelism_are_checked_against_the_model(moe_dir, tmp_path):
    from tandem.trainer.model_fit import model_fit_problems

    assert model_fit_problems(_cfg(), str(moe_dir)) == []
    lora = _cfg()
    lora.lora.rank = 8
    [(key, message)] = model_fit_problems(lora, str(moe_dir))
    assert key == "trainer.lora.rank" and "mixture-of-experts model (qwen3_moe, 4 experts per layer)" in message
    assert "trainer.lora.rank: 0" in message
    assert model_fit_problems(lora, str(mc.make_model_dir(tmp_path / "dense"))) == []   # dense: LoRA is fine
    ep = _cfg(backend="megatron", expert_parallel=3)
    assert model_fit_problems(ep, str(moe_dir)) == [
        ("trainer.expert_parallel", f"trainer.expert_parallel=3 must divide the 4 experts per layer of {moe_dir}")]
    [(key, message)] = model_fit_problems(ep, str(tmp_path / "dense"))
    assert key == "trainer.expert_parallel" and "has no experts" in message
    assert model_fit_problems(lora, str(tmp_path / "missing")) == []   # model_problem names that one


def test_tandem_config_check_refuses_lora_on_moe(tmp_path):
    """The launch check reads the model's config.json: LoRA on a MoE model is refused with its key,
    before any role starts (a directory as far as the check reads one: model_dirs.py)."""
    import json

    from model_dirs import checked_model_dir

    from tandem.launcher.config import load_config
    from tandem.launcher.preflight import resource_problems

    model = checked_model_dir(tmp_path / "moe")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 128}))
    exp = [f"experiment.model={model}", "experiment.name=x", f"experiment.exp_dir={tmp_path / 'x'}"]
    assert resource_problems(load_config(None, exp)) == []
    problems = dict(resource_problems(load_config(None, [*exp, "trainer.lora.rank=8"])))
    assert "128 experts per layer" in problems["trainer.lora.rank"]


def test_a_broadcast_names_the_experts_as_the_hub_does(moe_dir):
    """What the torch backend broadcasts is the checkpoint's own tensors, one per expert (SGLang's
    loader takes those names), and the embedded server fuses them back into what it serves."""
    from safetensors.torch import load_file

    from tandem.rollout.server import expert_weights, weights

    be = TorchBackend(_cfg(), moe_dir, seed=0)
    sent = dict(be.full_parameters())
    hub = load_file(str(moe_dir / "model.safetensors"))
    assert sorted(sent) == sorted(hub)
    for name, t in hub.items():
        assert torch.equal(sent[name], t), name
    served = expert_weights.served(be.model, sent, partial=True, error=weights.WeightError)
    weights.validate(be.model, served)   # every served tensor, none missing
    for name, t in be.model.state_dict().items():
        assert torch.equal(served[name], t), name
