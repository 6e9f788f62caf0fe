"""`tandem plan` / `tandem simulate` read a model directory's config.json into the shape their
memory and time estimates count: for every family the Megatron backend trains (Qwen2, Llama,
Qwen3, Mistral), the parameter count it derives is the transformers model's own, so an explicit
head_dim (Qwen3's 24 here, not hidden/heads = 16), q/k/v biases only where the family has them
and Qwen3's q/k norms are counted as they are."""
from __future__ import annotations

import megatron_case as mc
import megatron_families as mf
import pytest

from tandem.launcher.simulate.hardware import load_model_shape


@pytest.mark.parametrize("family", ["qwen2", *mf.FAMILIES])
def test_the_shape_counts_the_checkpoints_parameters(tmp_path, family):
    d = mc.make_model_dir(tmp_path, tied=False) if family == "qwen2" else mf.make_family_dir(tmp_path, family)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d)
    shape = load_model_shape("", str(d))
    assert shape.head_dim == (24 if family == "qwen3" else 16)
    assert shape.params == sum(p.numel() for p in model.parameters())
