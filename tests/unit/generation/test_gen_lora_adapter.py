"""The embedded server's adapter merge (rollout/server/lora.py through weights.py): a
`trainer.lora.sync: adapter` publication is merged onto the weights the server loaded at start.

The adapters are real: a torch-backend LoRA model (trainer/lora.py, peft) trained one step on
the small Qwen2 directory of tests/conftest.py, published by the real DiskPublisher; the
"server" is the model `rollout/server/main.py` loads (AutoModelForCausalLM of that directory)
with the functions `/load_lora_adapter` calls, without the HTTP layer (tests/integration/
generation/test_gen_lora_routes.py drives the routes, the LoRA end-to-end run the whole loop)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandem.rollout.server import weights
from tandem.trainer import lora
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import LoraConfig, TrainerConfig
from tandem.trainer.loss import PPOSettings, ppo_token_loss
from tandem.trainer.torch_backend import TorchBackend
from tandem.trainer.weights.disk import DiskPublisher

PROMPTS = [[3, 17, 42, 9, 100, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


def _trained(model_dir, traj, steps: int) -> TorchBackend:
    c = TrainerConfig(temperature=1.0, max_staleness=0)
    c.optim.lr = 1e-2
    c.lora = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"])
    be = TorchBackend(c, model_dir, 0)
    groups = [Group(f"g{g}", 0, g, [traj(f"g{g}", k, reward=float((g + k) % 2), seed=10 * g + k, out_len=4,
                                         prompt_len=3) for k in range(2)]) for g in range(2)]
    mp = plan_step(StepBatch.from_groups(groups), 1, 10_000, 1, 0, True, True).minibatches[0]

    def loss_fn(mb, out):
        f = mb.fields
        return ppo_token_loss(out.logp, f["behav_logp"], None, f["advantages"], f["loss_mask"],
                              PPOSettings(0.2, False, None), mp.n_valid)
    for _ in range(steps):
        assert be.train_step(mp.micro_batches, loss_fn, 1.0).applied
    return be


@pytest.fixture(scope="module")
def published(small_model_dir, tmp_path_factory, traj):
    """v1 and v2 of one run (one and two steps), and the merged tensors the trainer computes."""
    root = tmp_path_factory.mktemp("weights")
    be = _trained(small_model_dir, traj, 1)
    DiskPublisher(root, keep=5).publish(be, 1)
    merged1 = {n: t.clone() for n, t in lora.merged_tensors(be.model, params_only=False)}
    logits1 = [_logits(be.model, p) for p in PROMPTS]
    be2 = _trained(small_model_dir, traj, 2)
    DiskPublisher(root, keep=5).publish(be2, 2)
    merged2 = {n: t.clone() for n, t in lora.merged_tensors(be2.model, params_only=False)}
    return {"root": root, "merged": {1: merged1, 2: merged2}, "logits1": logits1}


def _server(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)[None]).logits[0]


def _update(model, path, base, model_dir):
    """An adapter directory as /load_lora_adapter applies it; a model directory as
    /update_weights_from_disk does."""
    adapter = (path / "adapter_config.json").is_file()
    update = weights.load_adapter(model, str(path), str(model_dir)) if adapter else weights.load_from_disk(model, str(path))
    weights.apply(model, update, base)


def _state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_publication_is_a_peft_adapter_directory(published, small_model_dir):
    v1 = published["root"] / "v1"
    assert {p.name for p in v1.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not list(v1.glob("model*.safetensors")) and not (v1 / "tokenizer.json").exists()
    cfg = json.loads((v1 / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["base_model_name_or_path"] == str(small_model_dir)


def test_server_serves_the_merged_model(published, small_model_dir):
    model, base = _server(small_model_dir), weights.AdapterBase()
    _update(model, published["root"] / "v1", base, small_model_dir)
    served = model.state_dict()
    assert {n for n, t in served.items() if not torch.equal(t, _server(small_model_dir).state_dict()[n])} == \
        {n for n in published["merged"][1] if any(m in n for m in ("q_proj.w", "v_proj.w", "down_proj.w"))}
    for name, t in published["merged"][1].items():   # addmm here, peft's matmul then add there
        assert torch.allclose(served[name], t, rtol=1e-6, atol=1e-7), name
    for p, expect in zip(PROMPTS, published["logits1"], strict=True):
        assert torch.allclose(_logits(model, p), expect, rtol=1e-5, atol=1e-5)


def test_v2_after_v1_equals_v2_alone_and_a_plain_update_is_the_new_base(published, small_model_dir):
    after, base = _server(small_model_dir), weights.AdapterBase()
    _update(after, published["root"] / "v1", base, small_model_dir)
    once = _state(after)
    _update(after, published["root"] / "v2", base, small_model_dir)
    alone = _server(small_model_dir)
    _update(alone, published["root"] / "v2", weights.AdapterBase(), small_model_dir)
    for (n, a), b in zip(after.state_dict().items(), alone.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert all(torch.allclose(after.state_dict()[n], t, rtol=1e-6, atol=1e-7) for n, t in published["merged"][2].items())
    # back to the base model (a full HF directory): later adapters merge onto it, not onto v2
    _update(after, small_model_dir, base, small_model_dir)
    fresh = _server(small_model_dir)
    assert all(torch.equal(a, b) for a, b in zip(after.state_dict().values(), fresh.state_dict().values(), strict=True))
    _update(after, published["root"] / "v1", base, small_model_dir)
    assert all(torch.equal(after.state_dict()[n], t) for n, t in once.items())


def _broken(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(str(dst / "adapter_model.safetensors"))
        save_file(tensors(state), str(dst / "adapter_model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(config(cfg)))
    return dst


def _rename_first(state):
    return {n.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"): t for n, t in state.items()}


def _bad_rank(state):
    k = next(n for n in sorted(state) if "v_proj.lora_A" in n)
    return {**state, k: torch.zeros(4, state[k].shape[1])}


def _drop_b(state):
    k = next(n for n in sorted(state) if "down_proj.lora_B" in n)
    return {n: t for n, t in state.items() if n != k}


def _not_linear(state):
    return {**state, "base_model.model.model.norm.lora_A.weight": torch.zeros(8, 32),
            "base_model.model.model.norm.lora_B.weight": torch.zeros(32, 8)}


@pytest.mark.parametrize("tensors, config, message", [
    (_rename_first, None, r"qq_proj.*not a Linear module"),
    (_bad_rank, None, r"v_proj\.lora_A\.weight: shape \[4, 32\].*expected \[8, 32\]"),
    (_drop_b, None, r"down_proj\.lora_B\.weight is missing"),
    (_not_linear, None, r"model\.norm.*not a Linear module"),
    (lambda s: {**s, "base_model.model.model.layers.0.mlp.up_proj.bias": torch.zeros(2)}, None,
     r"up_proj\.bias: not a LoRA A or B weight"),
    (None, lambda c: {**c, "base_model_name_or_path": "/elsewhere/Qwen2-7B"},
     r"adapter_config\.json: base_model_name_or_path '/elsewhere/Qwen2-7B' is not the model this server"),
    (None, lambda c: {**c, "use_dora": True}, r"adapter_config\.json: use_dora=True is not supported"),
    (None, lambda c: {**c, "r": 4}, r"lora_A\.weight: shape \[8, .*expected \[4,"),
])
def test_bad_adapter_is_refused_before_the_model_is_touched(published, small_model_dir, tmp_path, tensors, config,
                                                            message):
    model, base = _server(small_model_dir), weights.AdapterBase()
    _update(model, published["root"] / "v1", base, small_model_dir)
    before = _state(model)
    bad = _broken(published["root"] / "v2", tmp_path / "v3", tensors, config)
    with pytest.raises(weights.WeightError, match=message):
        _update(model, bad, base, small_model_dir)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
