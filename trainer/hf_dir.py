"""What a Hugging Face model directory holds besides its weights, and writing one.

Every writer of a model directory (the torch backend's publication, the Megatron converter's,
LoRA's merged model, `tandem export`) writes the weights and config itself and takes the rest —
tokenizer, chat template, generation config — from the model it started from, as it is. A leaf
module, so the writers need not import each other for it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

# Files of a HF directory that hold weights (re-written on export, never copied).
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def copy_tokenizer_files(base_dir: Path, out_dir: Path) -> None:
    """Every file of `base_dir` but its weights and config.json (each writer writes its own; a
    LoRA adapter directory has none) that `out_dir` does not have yet."""
    out_dir = Path(out_dir)
    for f in Path(base_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_FILES) and f.name != "config.json" \
                and not (out_dir / f.name).exists():
            # Content only: the copy's mode is the run's (private), not the source model's 0644.
            shutil.copyfile(f, out_dir / f.name)


def save_plain_model(state: dict, config, base_dir: Path, out_dir: Path) -> Path:
    """`out_dir` as a plain Hugging Face directory that `AutoModelForCausalLM.from_pretrained`
    loads: the model of `config` holding the tensors of `state` (a full state_dict, in its own
    dtype), built on the meta device so no second copy is made, and `base_dir`'s tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = next((t.dtype for t in state.values() if torch.is_floating_point(t)), torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(base_dir, out_dir)
    return out_dir
