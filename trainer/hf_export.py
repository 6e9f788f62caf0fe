"""A trainer checkpoint as a Hugging Face model directory (what `tandem eval --checkpoint` serves).

    python -m trainer.hf_export --checkpoints <exp>/checkpoints --version latest|N --model BASE --out DIR

Why here: a checkpoint (`checkpoint.py`: `step-<N>/rank-<r>.pt`) is the trainer's own resume
format — the model's `state_dict` inside each rank's backend state, next to optimizer and RNG
states — and only the trainer knows it. Evaluating a checkpoint needs what a generation server
loads: `config.json`, tokenizer files and `model.safetensors`. The step number of a checkpoint is
the policy version it holds (the loop saves `step-<version>` after training that version).

Run as its own process by the evaluator (so the other roles never import the trainer, and the
memory of the loaded state is returned before the server loads the model). It prints one JSON
line `{"version": N, "checkpoint": DIR, "out": DIR}` and exits 0; exit 2 with a message on stderr
when the checkpoint does not exist (naming those that do), 3 when it cannot be converted here
(a sharded Megatron checkpoint).

Only per-rank checkpoints of the torch backend convert: its ranks hold full replicas, so rank 0's
state is the whole model. A Megatron checkpoint is one sharded `dist/` directory in Megatron's
own layout (tensor/pipeline-parallel shards under Megatron names); turning that back into HF
tensors needs Megatron-core and the run's parallel layout, so it is refused with a pointer to the
weights the run published.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from trainer import checkpoint

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class NoSuchCheckpoint(ValueError):
    """The version asked for has no checkpoint (the message lists those that exist)."""


class NotConvertible(ValueError):
    """The checkpoint exists but cannot become an HF directory here."""


def resolve(root: Path, spec: str) -> tuple[int, Path]:
    """`latest`, `vN` or `N` -> (version, its checkpoint directory)."""
    root = Path(root)
    steps = checkpoint.checkpoint_steps(root)
    have = ", ".join(f"v{s}" for s in steps) or "none"
    m = re.fullmatch(r"v?(\d+)", spec.strip())
    if spec.strip() != "latest" and m is None:
        raise NoSuchCheckpoint(f"--checkpoint {spec!r}: expected vN, N or latest (checkpoints in {root}: {have})")
    if not steps:
        raise NoSuchCheckpoint(f"{root}: no checkpoint (the trainer writes one every "
                               f"trainer.checkpoint_every steps)")
    version = steps[-1] if m is None else int(m.group(1))
    if version not in steps:
        raise NoSuchCheckpoint(f"no checkpoint for v{version} in {root}; there are: {have}")
    return version, root / f"step-{version}"


def model_state(ckpt: Path, version: int, weights_root: Path | None = None) -> dict:
    """The model's state_dict held by a per-rank checkpoint."""
    published = Path(weights_root) / f"v{version}" if weights_root is not None else None
    hint = (f"; the run published this version as a Hugging Face directory, {published}: serve that"
            if published is not None and published.is_dir() else
            "; serve a version the run published under <exp>/weights/ (if still kept) instead")
    if (ckpt / checkpoint.SHARDED_DIR).is_dir():
        raise NotConvertible(f"{ckpt} is a sharded checkpoint (trainer.backend: megatron, Megatron's dist "
                             f"checkpointing): it cannot be converted to a Hugging Face model here{hint}")
    state, _ = checkpoint.load(ckpt, 0)
    model = state.get("backend", {}).get("model")
    if not isinstance(model, dict) or not model:
        raise NotConvertible(f"{ckpt}/rank-0.pt holds no model state (not written by the torch backend){hint}")
    return model


def export(ckpt: Path, version: int, base_model: Path, out: Path, weights_root: Path | None = None) -> Path:
    """Write `out/` (config and tokenizer of `base_model`, the checkpoint's weights as safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    state = model_state(ckpt, version, weights_root)
    dtype = next((t.dtype for t in state.values() if torch.is_floating_point(t)), torch.float32)
    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(base_model).iterdir():     # tokenizer, chat template, generation config
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.hf_export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", required=True, type=Path, help="<exp>/checkpoints")
    ap.add_argument("--version", default="latest", help="latest, vN or N")
    ap.add_argument("--model", required=True, type=Path, help="the run's base model (experiment.model)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--weights", type=Path, default=None, help="<exp>/weights (named in the Megatron refusal)")
    a = ap.parse_args(argv)
    try:
        version, ckpt = resolve(a.checkpoints, a.version)
        export(ckpt, version, a.model, a.out, a.weights)
    except NoSuchCheckpoint as e:
        print(e, file=sys.stderr)
        return 2
    except NotConvertible as e:
        print(e, file=sys.stderr)
        return 3
    print(json.dumps({"version": version, "checkpoint": str(ckpt), "out": str(a.out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
