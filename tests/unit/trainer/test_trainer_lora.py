"""LoRA on the torch backend (`trainer.lora`, trainer/lora.py): what trains, the KL reference,
the published weights (merged, or the adapter with `trainer.lora.sync: adapter`; the server's
side of an adapter is tests/unit/generation/test_gen_lora_adapter.py), checkpoints and `tandem
export` of both forms, and the config's refusals. The model is the small real Qwen2 directory of tests/conftest.py, in float32."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.launcher.config import ConfigError, load_config
from tandem.trainer import checkpoint, lora
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import LoraConfig, TrainerConfig
from tandem.trainer.hf_export import NotConvertible, export_run
from tandem.trainer.loss import PPOSettings, ppo_token_loss
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend
from tandem.trainer.weights.disk import DiskPublisher


def cfg(rank=8, sync="merged", **kw) -> TrainerConfig:
    c = TrainerConfig(temperature=1.0, max_staleness=0, **kw)
    c.optim.lr = 1e-2
    c.lora = LoraConfig(rank=rank, alpha=16.0, sync=sync)
    return c


def seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(7, 200, (int(n),), generator=g).numpy() for n in (5, 17, 9, 28)]


def _plan(traj):
    groups = [Group(f"g{g}", 0, g, [traj(f"g{g}", k, reward=float((g + k) % 2), seed=10 * g + k,
                                         out_len=3 + (g * 5 + k) % 9, prompt_len=2 + g) for k in range(2)])
              for g in range(3)]
    return plan_step(StepBatch.from_groups(groups), 1, 10_000, 1, 0, True, True).minibatches[0]


def _step(be, mp):
    def loss_fn(mb, out):
        f = mb.fields
        return ppo_token_loss(out.logp, f["behav_logp"], None, f["advantages"], f["loss_mask"],
                              PPOSettings(0.2, False, None), mp.n_valid)
    res = be.train_step(mp.micro_batches, loss_fn, 1.0)
    assert res.applied and res.grad_norm > 0
    return res


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)[None]).logits[0]


@pytest.fixture(scope="module")
def plain(small_model_dir):
    return TorchBackend(cfg(rank=0), small_model_dir, 0)


def test_only_the_adapters_train(small_model_dir):
    be = TorchBackend(cfg(), small_model_dir, 0)
    trainable = {n for n, p in be.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear projection of every layer got one (2 layers x 7 projections x A and B)
    assert len(trainable) == 2 * 7 * 2
    in_optimizer = {id(p) for g in be.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in be.model.named_parameters() if n in trainable}


def test_reference_is_the_base_model_and_stays_it_after_a_step(small_model_dir, plain, traj):
    be = TorchBackend(cfg(), small_model_dir, 0)
    mb = pack(seqs())
    base = plain.forward_logprobs(mb, 1.0).logp
    assert torch.equal(be.forward_ref_logprobs(mb, 1.0).logp, base)
    assert torch.equal(be.forward_logprobs(mb, 1.0).logp, base)      # B = 0: version 0 is the base model
    frozen = {n: p.detach().clone() for n, p in be.model.named_parameters() if not p.requires_grad}
    _step(be, _plan(traj))
    after = be.forward_logprobs(mb, 1.0).logp
    assert not torch.allclose(after, base, atol=1e-4)                 # the adapters moved the policy
    assert torch.equal(be.forward_ref_logprobs(mb, 1.0).logp, base)   # the reference did not move
    assert torch.equal(be.forward_logprobs(mb, 1.0).logp, after)      # and the adapters are back on
    assert all(torch.equal(p, frozen[n]) for n, p in be.model.named_parameters() if not p.requires_grad)


def test_published_weights_are_the_merged_model_under_plain_names(small_model_dir, traj, tmp_path):
    be = TorchBackend(cfg(), small_model_dir, 0)
    _step(be, _plan(traj))
    live = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    DiskPublisher(tmp_path / "weights", keep=1).publish(be, 1)
    assert all(torch.equal(p, live[n]) for n, p in be.model.named_parameters())   # nothing merged in place
    pub = tmp_path / "weights" / "v1"
    assert not (pub / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(pub, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32)
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in loaded.named_parameters()] == names
    # the broadcast sends the same tensors, under the same names, in the plain model's order
    sent = list(be.full_parameters())
    assert [n for n, _ in sent] == names
    for (n, t), (_, q) in zip(sent, loaded.named_parameters(), strict=True):
        assert torch.equal(t, q), n
    for s in seqs():
        with torch.no_grad():
            expect = be.model(input_ids=torch.tensor(s)[None]).logits[0]
        got = _logits(loaded, s)
        assert torch.allclose(got, expect, rtol=1e-5, atol=1e-5), (got - expect).abs().max()
        assert not torch.allclose(_logits(reference, s), expect, atol=1e-4)


def test_checkpoint_holds_the_adapters_and_resumes_exactly(small_model_dir, traj, tmp_path):
    mp = _plan(traj)
    be = TorchBackend(cfg(), small_model_dir, 0)
    _step(be, mp)
    state = be.state_dict()
    assert "model" not in state and state["lora"]["rank"] == 8
    assert set(state["adapter"]) and all(".lora_" in k for k in state["adapter"])
    checkpoint.save(tmp_path / "ckpt", 1, 0, {"backend": state}, {"version": 1}, keep=1)
    rank_state, _ = checkpoint.load(tmp_path / "ckpt" / "step-1", 0)
    fresh = TorchBackend(cfg(), small_model_dir, seed=1)     # other initial adapters, overwritten
    fresh.load_state_dict(rank_state["backend"])
    mb = pack(seqs())
    assert torch.equal(fresh.forward_logprobs(mb, 1.0).logp, be.forward_logprobs(mb, 1.0).logp)
    _step(be, mp)
    _step(fresh, mp)    # the same next step: adapters and optimizer moments were restored
    for (n, p), (_, q) in zip(be.model.named_parameters(), fresh.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="trainer.lora"):
        TorchBackend(cfg(rank=0), small_model_dir, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="trainer.lora"):
        TorchBackend(cfg(rank=4), small_model_dir, 0).load_state_dict(state)


def test_export_writes_the_merged_model_or_the_adapter(small_model_dir, traj, tmp_path):
    be = TorchBackend(cfg(), small_model_dir, 0)
    _step(be, _plan(traj))
    exp = tmp_path / "exp"
    checkpoint.save(exp / "checkpoints", 1, 0, {"backend": be.state_dict()}, {"version": 1}, keep=1)
    merged = export_run(exp, small_model_dir, tmp_path / "merged")
    adapter = export_run(exp, small_model_dir, tmp_path / "adapter", adapter=True)
    assert merged["from"] == adapter["from"] == "checkpoints/step-1" and adapter["adapter"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    plain_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32), tmp_path / "adapter")
    for s in seqs():
        with torch.no_grad():
            expect = be.model(input_ids=torch.tensor(s)[None]).logits[0]
        assert torch.allclose(_logits(plain_model, s), expect, rtol=1e-5, atol=1e-5)
        assert torch.equal(_logits(with_adapter, s), expect)
    # the merged export of the checkpoint is what the run publishes
    DiskPublisher(tmp_path / "weights", keep=1).publish(be, 1)
    for a, b in zip(plain_model.parameters(), AutoModelForCausalLM.from_pretrained(
            tmp_path / "weights" / "v1", dtype=torch.float32).parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_adapter_publication_exports_as_the_merged_model_or_as_itself(small_model_dir, traj, tmp_path):
    be = TorchBackend(cfg(sync="adapter"), small_model_dir, 0)
    _step(be, _plan(traj))
    exp = tmp_path / "exp"
    DiskPublisher(exp / "weights", keep=1).publish(be, 1)
    assert (exp / "weights" / "v1" / "adapter_config.json").is_file()
    merged = export_run(exp, small_model_dir, tmp_path / "merged")
    adapter = export_run(exp, small_model_dir, tmp_path / "adapter", adapter=True)
    assert merged["from"] == adapter["from"] == "weights/v1" and merged["dtype"] == "float32"
    plain_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    expect = dict(lora.merged_tensors(be.model, params_only=False))
    assert all(torch.equal(t, expect[n]) for n, t in plain_model.state_dict().items())
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()    # the base model's, beside it
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (exp / "weights" / "v1" / "adapter_model.safetensors").read_bytes()


def test_export_adapter_of_a_full_model_run_is_refused(small_model_dir, plain, tmp_path):
    exp = tmp_path / "exp"
    checkpoint.save(exp / "checkpoints", 1, 0, {"backend": plain.state_dict()}, {"version": 1}, keep=1)
    with pytest.raises(NotConvertible, match="without --adapter"):
        export_run(exp, small_model_dir, tmp_path / "out", adapter=True)


def test_config_refuses_dropout_megatron_and_unknown_modules(small_model_dir, tmp_path):
    exp = ["experiment.model=m", "experiment.name=x", f"experiment.exp_dir={tmp_path / 'x'}"]
    with pytest.raises(ConfigError, match=r"trainer\.lora\.dropout: must be 0"):
        load_config(None, [*exp, "trainer.lora.rank=8", "trainer.lora.dropout=0.05"])
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank: .*torch backend only.*trainer\.backend is 'megatron'"):
        load_config(None, [*exp, "trainer.lora.rank=8", "trainer.backend=megatron"])
    assert load_config(None, [*exp, "trainer.backend=megatron"]).trainer.lora.rank == 0
    with pytest.raises(ConfigError, match=r"trainer\.lora\.sync: .*trainer\.weight_sync is 'broadcast'.*"
                                          r"set trainer\.lora\.sync: merged"):
        load_config(None, [*exp, "trainer.lora.rank=8", "trainer.weight_sync=broadcast"])
    # adapters reach SGLang over /load_lora_adapter: its modules only, always under an abort pause
    assert load_config(None, [*exp, "trainer.lora.rank=8", "gen.backend=sglang"]).trainer.lora.adapter_sync
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: \['c_attn'\] cannot take a LoRA "
                                          r"adapter in SGLang"):
        load_config(None, [*exp, "trainer.lora.rank=8", "gen.backend=sglang", "trainer.lora.target_modules=[c_attn]"])
    with pytest.raises(ConfigError, match=r"controller\.interruptible: false cannot hold with trainer\.lora\.sync: "
                                          r"adapter"):
        load_config(None, [*exp, "trainer.lora.rank=8", "controller.interruptible=false"])
    with pytest.raises(ConfigError, match=r"trainer\.lora\.sync: must be one of \['adapter', 'merged'\]"):
        load_config(None, [*exp, "trainer.lora.rank=8", "trainer.lora.sync=delta"])
    for ok in (["trainer.weight_sync=broadcast"], ["gen.backend=sglang", "trainer.lora.target_modules=[c_attn]"],
               ["controller.interruptible=false"]):
        assert load_config(None, [*exp, "trainer.lora.rank=8", "trainer.lora.sync=merged", *ok]).trainer.lora.sync \
            == "merged"
    c = cfg()
    c.lora.target_modules = ["q_proj", "qkv_proj"]
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: \['qkv_proj'\]"):
        TorchBackend(c, small_model_dir, 0)


def test_the_initial_adapter_is_the_publications_shape_all_zero(small_model_dir, tmp_path):
    """Version 0 as an adapter directory (what servers start serving, `--lora-paths`): the same
    tensors, shapes and config as the trainer's own publication of the same settings, all zero,
    trained on experiment.model; built without reading the base weights."""
    c = cfg(sync="adapter")
    be = TorchBackend(c, small_model_dir, 0)
    DiskPublisher(tmp_path / "weights", keep=1).publish(be, 1)
    lora.write_initial_adapter(lora.lora_settings(c.lora), small_model_dir, tmp_path / "v0")
    published, initial = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("weights/v1", "v0"))
    assert {k: v.shape for k, v in initial.items()} == {k: v.shape for k, v in published.items()}
    assert all(v.dtype == published[k].dtype and not v.any() for k, v in initial.items())
    want, got = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("weights/v1", "v0"))
    assert {k: got[k] for k in ("r", "lora_alpha", "base_model_name_or_path", "peft_type")} == \
        {k: want[k] for k in ("r", "lora_alpha", "base_model_name_or_path", "peft_type")}
    assert sorted(got["target_modules"]) == sorted(want["target_modules"])
