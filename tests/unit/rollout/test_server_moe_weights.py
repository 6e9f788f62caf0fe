"""The embedded server takes weight updates of a mixture-of-experts model (rollout/server/
expert_weights.py): transformers 5 serves a Qwen3-MoE layer's experts fused (`gate_up_proj`,
`down_proj`), while a published version, on disk or broadcast, names one tensor per expert as the
Hub and SGLang do. From disk the whole model must come; a broadcast may send part of it and
changes only what it names; a wrong expert is refused naming it, the served weights untouched."""
from __future__ import annotations

import megatron_case as mc
import megatron_moe_case as mm
import pytest
import torch
from safetensors.torch import load_file

from tandem.rollout.server import expert_weights, weights


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return [mm.make_moe_dir(tmp_path_factory.mktemp(f"moe{seed}"), seed=seed) for seed in (0, 1)]


def _served(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_a_version_on_disk_replaces_every_expert(dirs):
    model, newer = _served(dirs[0]), _served(dirs[1])
    update = weights.load_from_disk(model, str(dirs[1]))
    assert "model.layers.0.mlp.experts.gate_up_proj" in update and "model.layers.0.mlp.experts.0.up_proj.weight" not in update
    weights.apply(model, update, weights.AdapterBase())
    for name, t in newer.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    ids = mc.micro_batches(0)[0].input_ids[None]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, newer(input_ids=ids).logits, rtol=0, atol=0)


def test_a_broadcast_of_some_experts_changes_only_those(dirs):
    model = _served(dirs[0])
    before = {n: t.clone() for n, t in model.state_dict().items()}
    hub = load_file(str(dirs[1] / "model.safetensors"))
    part = {k: hub[k] for k in ("model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight")}
    update = expert_weights.served(model, part, partial=True, error=weights.WeightError)
    weights.validate(model, update, partial=True)
    assert sorted(update) == ["model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    gate_up = update["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[2, 32:], part["model.layers.1.mlp.experts.2.up_proj.weight"])   # up rows after the 32 gate rows
    assert torch.equal(gate_up[2, :32], before["model.layers.1.mlp.experts.gate_up_proj"][2, :32])
    mask = torch.ones(4, dtype=torch.bool)
    mask[2] = False
    assert torch.equal(gate_up[mask], before["model.layers.1.mlp.experts.gate_up_proj"][mask])
    assert torch.equal(update["model.layers.0.mlp.experts.down_proj"][3], part["model.layers.0.mlp.experts.3.down_proj.weight"])
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())   # nothing copied in yet


def test_a_wrong_or_missing_expert_is_refused_by_name(dirs, tmp_path):
    model = _served(dirs[0])
    hub = load_file(str(dirs[1] / "model.safetensors"))
    with pytest.raises(weights.WeightError, match=r"experts\.7\.gate_proj\.weight: the served model has 4 experts"):
        expert_weights.served(model, {"model.layers.0.mlp.experts.7.gate_proj.weight": torch.zeros(32, 64)},
                              partial=True, error=weights.WeightError)
    with pytest.raises(weights.WeightError, match=r"experts\.1\.down_proj\.weight: shape \[64, 31\] != served \[64, 32\]"):
        expert_weights.served(model, {"model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(64, 31)},
                              partial=True, error=weights.WeightError)
    from safetensors.torch import save_file
    (tmp_path / "v").mkdir()
    save_file({k: v for k, v in hub.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"},
              str(tmp_path / "v" / "model.safetensors"))
    with pytest.raises(weights.WeightError, match=r"missing tensors: \['model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'\]"):
        weights.load_from_disk(model, str(tmp_path / "v"))
