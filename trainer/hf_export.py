"""A run's policy as a Hugging Face model directory: `tandem export` and what `tandem eval
--checkpoint` serves.

    tandem export --exp DIR [--version N] [--from auto|weights|checkpoint] [--adapter] OUT
    python -m tandem.trainer.hf_export --checkpoints <exp>/checkpoints --version latest|N --model BASE --out DIR
    python -m tandem.trainer.hf_export --adapter-dir <exp>/weights/vN --model BASE --out DIR

Which weights "version N" is, in the order `--from auto` tries them:

1. `<exp>/weights/vN/`, when the run still has it: the directory the generation servers loaded
   for version N (the trainer publishes one per step with `trainer.weight_sync: disk` and keeps the
   newest `keep_weights`; every run that reaches `total_steps` leaves its final version there,
   whatever the weight sync). Copied as it is: the exact weights, nothing to convert.
2. `<exp>/checkpoints/step-N/` (the trainer's resume format; the step number is the version it
   holds): the torch backend's rank 0 holds the whole model's `state_dict` (its ranks are
   replicas); the Megatron backend's `dist/` is converted in this process on the CPU with
   megatron-core (trainer/megatron/export.py: any parallel layout, the float32 main weights, the
   same tensors as `weights/vN`).

The version defaults to the newest either holds (the run's final policy once it has ended).

A run trained with `trainer.lora` publishes its adapters (`trainer.lora.sync: adapter`, peft's
adapter directory in `weights/vN`) or the merged model (`merged`), and its checkpoints hold the
adapters and their settings. Either exports as the merged model (the base model, the adapters and
`trainer/lora.py`'s merge: the same tensors the servers serve), or, with `--adapter`, as peft's
adapter directory (adapter_config.json, adapter_model.safetensors) that
`PeftModel.from_pretrained(<base model>, OUT)` loads, from a checkpoint or an adapter publication
(copied as it is).

`python -m tandem.trainer.hf_export --adapter-dir <exp>/weights/vN --model BASE --out DIR` merges one
published adapter directory (what `tandem eval --checkpoint final` serves for such a run).

Why here: only the trainer knows its checkpoint formats. The evaluator runs the module form as its
own process (so the other roles never import the trainer, and the memory of the loaded state is
returned before the server loads the model); it prints one JSON line `{"version": N, "checkpoint":
DIR, "out": DIR}` and exits 0; exit 2 with a message on stderr when the checkpoint does not exist
(naming those that do), 3 when it cannot be converted (a checkpoint holding no model state, an
incomplete `dist/`).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from tandem.services.protocol import numbered_dirs
from tandem.trainer.hf_dir import save_plain_model


class NoSuchCheckpoint(ValueError):
    """The version asked for has no checkpoint (the message lists those that exist)."""


class NotConvertible(ValueError):
    """The checkpoint exists but cannot become an HF directory here."""


def resolve(root: Path, spec: str) -> tuple[int, Path]:
    """`latest`, `vN` or `N` -> (version, its checkpoint directory)."""
    root = Path(root)
    steps = numbered_dirs(root, "step-")
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


def _hint(version: int, weights_root: Path | None) -> str:
    published = Path(weights_root) / f"v{version}" if weights_root is not None else None
    return (f"; the run published this version as a Hugging Face directory, {published}: serve that"
            if published is not None and published.is_dir() else
            "; serve a version the run published under <exp>/weights/ (if still kept) instead")


def backend_state(ckpt: Path, version: int, weights_root: Path | None = None) -> dict:
    """The torch backend's state in a per-rank checkpoint: the whole model's state_dict
    (`model`), or LoRA adapters (`adapter`) with their settings (`lora`)."""
    from tandem.trainer import checkpoint

    hint = _hint(version, weights_root)
    state, _ = checkpoint.load(ckpt, 0)
    backend = state.get("backend", {})
    adapter = backend.get("adapter")
    if isinstance(adapter, dict) and adapter and isinstance(backend.get("lora"), dict):
        return backend
    model = backend.get("model")
    if not isinstance(model, dict) or not model:
        raise NotConvertible(f"{ckpt}/rank-0.pt holds no model state (not written by the torch backend){hint}")
    return backend


def _export_lora(state: dict, base_model: Path, out: Path, adapter: bool) -> Path:
    """The base model with the checkpoint's adapters: merged, or peft's adapter directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.trainer import lora

    dtype = next(t.dtype for t in state["adapter"].values() if torch.is_floating_point(t))
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype), state["lora"], seed=0)
    lora.load_adapter_state(model, state["adapter"])
    (lora.save_adapter if adapter else lora.save_merged)(model, Path(base_model), Path(out))
    return Path(out)


def _export_sharded(ckpt: Path, version: int, base_model: Path, out: Path, weights_root: Path | None,
                    vocab_multiple: int) -> Path:
    """A Megatron checkpoint's `dist/` through megatron-core, in this process (export.py)."""
    from tandem.trainer import checkpoint
    from tandem.trainer.megatron.export import hf_state_from_dist, write_hf_dir

    dist_dir = checkpoint.sharded_dir(ckpt)
    try:
        if not (dist_dir / "metadata.json").is_file():
            raise ValueError(f"{dist_dir} has no metadata.json (an incomplete Megatron dist checkpoint)")
        state = hf_state_from_dist(dist_dir, base_model, vocab_multiple)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        raise NotConvertible(f"{ckpt} is a sharded checkpoint (trainer.backend: megatron, Megatron's dist "
                             f"checkpointing) that cannot be read: {e}{_hint(version, weights_root)}") from None
    write_hf_dir(state, base_model, out)
    return Path(out)


def export(ckpt: Path, version: int, base_model: Path, out: Path, weights_root: Path | None = None,
           vocab_multiple: int = 128, adapter: bool = False) -> Path:
    """Write `out/` (config and tokenizer of `base_model`, the checkpoint's weights as safetensors);
    `adapter`: the checkpoint's LoRA adapters as peft's adapter directory instead."""
    from transformers import AutoConfig

    from tandem.trainer import checkpoint

    if (ckpt / checkpoint.SHARDED_DIR).is_dir():
        if adapter:
            raise NotConvertible(f"{ckpt} was written by the Megatron backend, which trains no LoRA adapters: "
                                 f"export it without --adapter")
        return _export_sharded(ckpt, version, base_model, out, weights_root, vocab_multiple)
    backend = backend_state(ckpt, version, weights_root)
    if "adapter" in backend:
        return _export_lora(backend, base_model, out, adapter)
    if adapter:
        raise NotConvertible(f"{ckpt} holds the whole model (the run did not use trainer.lora): there is no "
                             f"adapter; export it without --adapter")
    return save_plain_model(backend["model"], AutoConfig.from_pretrained(base_model), Path(base_model), Path(out))


def lora_adapter_dir(path: Path) -> bool:
    """Whether `path` is peft's adapter directory (a `trainer.lora.sync: adapter` publication)."""
    return (Path(path) / "adapter_config.json").is_file()


def merge_published_adapter(adapter_dir: Path, base_model: Path, out: Path) -> Path:
    """A published adapter directory merged onto the run's base model: a plain HF directory."""
    from tandem.trainer import lora

    lora.merge_adapter_dir(Path(adapter_dir), Path(base_model), Path(out))
    return Path(out)


def _dtype(out: Path) -> str:
    """The dtype of the exported weights (the first tensor's; every tensor of a run has it)."""
    from safetensors import safe_open

    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                kind = str(st.get_slice(key).get_dtype())
                return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(kind, kind)
    return "?"


def export_run(exp_root: Path, base_model: Path, out: Path, version: str | None = None, source: str = "auto",
               vocab_multiple: int = 128, adapter: bool = False) -> dict:
    """`tandem export`: version `version` (vN or N; None = the newest) of the run in `exp_root` as a
    Hugging Face directory `out`, from `weights/vN` or `checkpoints/step-N` (module docstring);
    `adapter`: a LoRA run's adapters as peft's directory, from its checkpoints only.
    Written in a temp directory beside `out` and renamed, so a failed export leaves nothing; an
    existing non-empty `out` is refused. Returns what was exported, from where, in which dtype."""
    exp_root, out = Path(exp_root), Path(out)
    weights_root, ckpt_root = exp_root / "weights", exp_root / "checkpoints"
    published, checkpointed = numbered_dirs(weights_root, "v"), numbered_dirs(ckpt_root, "step-")
    newest = max(published + checkpointed, default=None)
    if adapter:     # only checkpoints and adapter publications (trainer.lora.sync: adapter) hold them
        published = [v for v in published if lora_adapter_dir(weights_root / f"v{v}")]
    if source == "weights":
        checkpointed = []
    elif source == "checkpoint":
        published = []
    have = sorted(set(published) | set(checkpointed))
    listed = (f"published weights: {', '.join(f'v{v}' for v in published) or 'none'}; checkpoints: "
              f"{', '.join(f'v{v}' for v in checkpointed) or 'none'}")
    if not have:
        raise NoSuchCheckpoint(f"{exp_root}: nothing to export ({listed}{'' if source == 'auto' else f', --from {source}'})")
    m = re.fullmatch(r"v?(\d+)", (version or "").strip())
    if version is not None and m is None:
        raise NoSuchCheckpoint(f"--version {version!r}: expected vN or N ({listed})")
    v = have[-1] if m is None else int(m.group(1))
    if v not in have:
        raise NoSuchCheckpoint(f"{exp_root} holds no version {v} ({listed})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NoSuchCheckpoint(f"{out} exists and is not an empty directory: choose another output")
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    published_dir = weights_root / f"v{v}"
    try:
        if v in published and lora_adapter_dir(published_dir) and not adapter:
            merge_published_adapter(published_dir, base_model, tmp)
            origin = f"weights/v{v}"
        elif v in published:
            shutil.copytree(published_dir, tmp)
            origin = f"weights/v{v}"
        else:
            export(ckpt_root / f"step-{v}", v, base_model, tmp, weights_root, vocab_multiple, adapter)
            origin = f"checkpoints/step-{v}"
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"version": v, "from": origin, "out": str(out), "dtype": _dtype(out), "final": v == newest,
            "adapter": adapter}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.trainer.hf_export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=Path, help="<exp>/checkpoints")
    ap.add_argument("--adapter-dir", type=Path, default=None,
                    help="instead of a checkpoint: a published LoRA adapter directory (<exp>/weights/vN) to merge")
    ap.add_argument("--version", default="latest", help="latest, vN or N")
    ap.add_argument("--model", required=True, type=Path, help="the run's base model (experiment.model)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--weights", type=Path, default=None, help="<exp>/weights (named in the Megatron refusal)")
    a = ap.parse_args(argv)
    if (a.checkpoints is None) == (a.adapter_dir is None):
        ap.error("give one of --checkpoints and --adapter-dir")
    try:
        if a.adapter_dir is not None:
            m = re.fullmatch(r"v(\d+)", a.adapter_dir.name)
            if not lora_adapter_dir(a.adapter_dir):
                raise NoSuchCheckpoint(f"{a.adapter_dir} is not a LoRA adapter directory (no adapter_config.json)")
            version, ckpt = (int(m.group(1)) if m else -1), a.adapter_dir
            merge_published_adapter(a.adapter_dir, a.model, a.out)
        else:
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
    from tandem.services.protocol import exit_process
    exit_process(main())
