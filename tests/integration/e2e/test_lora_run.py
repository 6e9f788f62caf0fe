"""LoRA end to end: `tandem run` on the tiny model with `trainer.lora.rank=8` (every role a real
process, the disk weight sync), two steps, then `tandem export --adapter` as a user runs it.

What it shows beyond the unit tier (tests/unit/trainer/test_trainer_lora.py): the setting reaches
the trainer through the resolved config; the generation server loads the merged weights the
trainer publishes (plain Hugging Face names, the base model's tensors everywhere but the adapted
projections, which moved); the run checkpoints the adapters, not the model; and the CLI writes
the adapter directory from that checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from local_run import finish, leftovers, steps, tandem, write_config
from safetensors.torch import load_file

from services.protocol import ExpDir


def test_a_lora_run_trains_its_adapters_and_publishes_merged_weights(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path / "exp.yaml", tiny_model_dir, "lora")
    # The untrained model answers everything wrong: with the group baseline every advantage would
    # be 0 and nothing would train, so each sample keeps its own (negative) reward as advantage.
    out = finish(tandem("run", cfg, "trainer.lora.rank=8", "trainer.total_steps=2", "trainer.optim.lr=1e-3",
                        "trainer.group_baseline=false", "trainer.normalize_advantages=false"))
    exp = ExpDir(tmp_path / "lora")
    assert "step 2/2" in out, out[-3000:]
    records = steps(exp)
    assert [r["step"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)

    base = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(exp.weights / "v2" / "model.safetensors")
    assert final.keys() == base.keys()          # merged: the plain names, no adapter tensors
    moved = {k for k in base if not torch.equal(base[k], final[k])}
    assert moved and all(k.endswith("_proj.weight") for k in moved), sorted(moved)
    assert any(k.endswith("q_proj.weight") for k in moved) and any(k.endswith("down_proj.weight") for k in moved)

    state = torch.load(exp.checkpoints / "step-2" / "rank-0.pt", map_location="cpu", weights_only=True)["backend"]
    assert "model" not in state and state["lora"]["rank"] == 8 and state["adapter"]

    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "export", "--exp", str(exp.root), "--adapter",
                           "--json", str(tmp_path / "adapter")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["version"] == 2 and done["from"] == "checkpoints/step-2" and done["adapter"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert leftovers(exp) == []
