"""LoRA end to end: `tandem run` on the tiny model with `trainer.lora.rank=8` (every role a real
process, the disk weight sync with the default `trainer.lora.sync: adapter`), two steps, then
`tandem export` as a user runs it.

What it shows beyond the unit tier (tests/unit/trainer/test_trainer_lora.py, and
tests/unit/generation/test_gen_lora_adapter.py for the server's merge): the setting reaches the
trainer through the resolved config; every published version is peft's adapter directory, which
the controller swaps in on the generation server over /load_lora_adapter (the server started
serving version 0's zero adapter under the name every request gives); the run checkpoints the adapters, not the model; and the CLI turns the final published
adapter into the same plain model as the merge of the final checkpoint, and writes the adapter
directory."""
from __future__ import annotations

import json

import torch
from local_run import export, finish, leftovers, steps, tandem, write_config
from safetensors.torch import load_file

from tandem.services.protocol import ExpDir, read_metrics
from tandem.trainer.batch import StepBatch, plan_step
from tandem.trainer.buffer import Group
from tandem.trainer.config import LoraConfig, TrainerConfig
from tandem.trainer.loss import PPOSettings, ppo_token_loss


def test_a_lora_run_publishes_adapters_the_server_applies(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "lora")
    # The untrained model answers everything wrong: with the group baseline every advantage would
    # be 0 and nothing would train, so each sample keeps its own (negative) reward as advantage.
    out = finish(tandem("run", cfg, "trainer.lora.rank=8", "trainer.total_steps=2", "trainer.optim.lr=1e-3",
                        "trainer.group_baseline=false", "trainer.normalize_advantages=false"))
    exp = ExpDir(tmp_path / "lora")
    assert "step 2/2" in out, out[-3000:]
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)

    published = sorted(p for p in exp.weights.iterdir() if p.is_dir())
    assert [p.name for p in published] == ["v1", "v2"]
    for p in published:     # adapters only: no model weights, no tokenizer
        assert {f.name for f in p.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        assert not list(p.glob("model*.safetensors")) and not (p / "config.json").exists()
    adapter = load_file(exp.weights / "v2" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    # the controller swapped each version's adapter in over the LoRA routes, on every server
    syncs = read_metrics(exp, "controller", "weight_sync")
    assert [(r["version"], r["method"], r["failed"]) for r in syncs] == [(1, "adapter_on_disk", {}),
                                                                         (2, "adapter_on_disk", {})], syncs
    gen_log = exp.log_file("gen", 0).read_text()
    for v in (1, 2):
        assert f"LoRA adapter policy loaded from {exp.weights / f'v{v}'}" in gen_log, gen_log[-3000:]
    assert f"LoRA adapter policy loaded from {exp.initial_adapter}" in gen_log   # version 0, at start

    state = torch.load(exp.checkpoints / "step-2" / "rank-0.pt", map_location="cpu", weights_only=True)["backend"]
    assert "model" not in state and state["lora"]["rank"] == 8 and state["adapter"]

    from_weights = export(exp, tmp_path / "final")
    from_checkpoint = export(exp, tmp_path / "ckpt", "--from", "checkpoint")
    assert from_weights["from"] == "weights/v2" and from_checkpoint["from"] == "checkpoints/step-2"
    base = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(tmp_path / "final" / "model.safetensors")
    merged = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert final.keys() == base.keys() == merged.keys()       # a plain model: no adapter tensors
    assert all(torch.equal(final[k], merged[k]) for k in base)
    moved = {k for k in base if not torch.equal(base[k], final[k])}
    assert moved and all(k.endswith("_proj.weight") for k in moved), sorted(moved)
    assert any(k.endswith("q_proj.weight") for k in moved) and any(k.endswith("down_proj.weight") for k in moved)

    done = export(exp, tmp_path / "adapter", "--adapter")
    assert done["version"] == 2 and done["from"] == "weights/v2" and done["adapter"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert leftovers(exp) == []


def test_eval_of_a_final_adapter_version_serves_it_merged(small_model_dir, traj, tmp_path):
    """`tandem eval --checkpoint final` on an adapter publication (no checkpoint): the model it
    serves is `python -m tandem.trainer.hf_export --adapter-dir` (a real subprocess), the trainer's
    merged tensors."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from tandem.rollout.checkpoint_eval import model_for
    from tandem.trainer import lora
    from tandem.trainer.torch_backend import TorchBackend
    from tandem.trainer.weights.disk import DiskPublisher

    c = TrainerConfig(temperature=1.0, max_staleness=0)
    c.optim.lr = 1e-2
    c.lora = LoraConfig(rank=8, alpha=16.0)
    be = TorchBackend(c, small_model_dir, 0)
    groups = [Group(f"g{g}", 0, g, [traj(f"g{g}", k, reward=float((g + k) % 2), seed=10 * g + k, out_len=4,
                                         prompt_len=3) for k in range(2)]) for g in range(2)]
    mp = plan_step(StepBatch.from_groups(groups), 1, 10_000, 1, 0, True, True).minibatches[0]
    res = be.train_step(mp.micro_batches, lambda mb, out: ppo_token_loss(
        out.logp, mb.fields["behav_logp"], None, mb.fields["advantages"], mb.fields["loss_mask"],
        PPOSettings(0.2, False, None), mp.n_valid), 1.0)
    assert res.applied
    exp = ExpDir(tmp_path / "exp")
    DiskPublisher(exp.weights, keep=1).publish(be, 1)
    (tmp_path / "tmp").mkdir()
    version, served, what = asyncio.run(model_for(exp, "final", str(small_model_dir), tmp_path / "tmp"))
    assert version == 1 and served == tmp_path / "tmp" / "model" and "merged onto" in what
    loaded = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
    expect = dict(lora.merged_tensors(be.model, params_only=False))
    assert all(torch.equal(t, expect[n]) for n, t in loaded.state_dict().items())
