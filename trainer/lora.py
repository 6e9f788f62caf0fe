"""LoRA on the torch backend (`trainer.lora.rank > 0`): peft's adapters around a frozen model.

What the rest of the trainer sees stays what it was without LoRA:

- Training: only the adapters' parameters require a gradient, so the backend's optimizer, the
  data-parallel all-reduce and the gradient clip see them alone (and the optimizer state is the
  adapters' size). Dropout is refused in the config (trainer/config.py `LoraConfig`): the model
  runs without dropout so the proximal and the first update's log-probs are the same numbers.
- The KL penalty's reference (the initial policy) is the same model with its adapters off
  (`PeftModel.disable_adapter()`): peft initialises B = 0, so version 0 with adapters on is
  exactly the base model, and no second copy of the model is needed.
- Publication (`trainer.lora.sync`): `adapter` (the default, disk weight sync only) writes peft's
  adapter directory to `<exp>/weights/v<N>/`, which the embedded server merges onto the model it
  loaded (rollout/server/lora.py) and `tandem export` merges onto experiment.model
  (`merge_adapter_dir`); `merged` gives the servers the merged model, W + (alpha / r) B A under
  the plain Hugging Face names (no `base_model.model.` prefix, no adapter tensors), so every
  weight-sync path and every server (SGLang) loads it unchanged. The merged tensors are computed
  beside the live model, never by merging into it (`merge_and_unload` would change the weights
  the next step trains from, and unmerging does not give back the same bits).
- Checkpoints hold the adapters (peft's state-dict names) and their optimizer state, plus the
  LoRA settings they were trained with (`lora_settings`), so a resume and `tandem export`
  rebuild the same wrapped model from the base model.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from tandem.trainer.hf_dir import copy_tokenizer_files, save_plain_model

# The adapter name peft gives a single adapter (its state-dict names omit it).
ADAPTER = "default"


def lora_settings(lcfg) -> dict:
    """What a checkpoint records about its adapters (plain values, for `torch.load(weights_only)`)."""
    return {"rank": int(lcfg.rank), "alpha": float(lcfg.alpha), "dropout": float(lcfg.dropout),
            "target_modules": [str(m) for m in lcfg.target_modules]}


def peft_config(settings: dict):
    """peft's `LoraConfig` for `lora_settings(...)`: adapters on the named modules' weights only
    (no bias), B initialised to zero (so the wrapped model starts as the base model)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                          target_modules=list(settings["target_modules"]), bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, settings: dict, seed: int):
    """`model` with LoRA adapters; its own weights frozen. The adapters' A is drawn from a
    generator seeded with `seed` only, so every data-parallel rank starts with the same adapters
    whatever it did with the global generator before."""
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in settings["target_modules"] if m not in names]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {missing} name no module of the model "
                         f"({type(model).__name__}); its linear modules are "
                         f"{sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(settings))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' tensors under peft's names (as `save_pretrained` writes them), on the CPU."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: the base model's embeddings never train here, and peft's "auto"
    # would read the base model's config (from the Hub, for a model id) at every checkpoint.
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `adapter_state`; every adapter tensor must be given, nothing else."""
    from peft import set_peft_model_state_dict

    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = sorted(expected & set(result.missing_keys))
    if result.unexpected_keys or missing:
        raise ValueError(f"adapter state does not fit the model: unexpected {sorted(result.unexpected_keys)[:4]}, "
                         f"missing {missing[:4]}")


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _plain(name: str) -> str:
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_tensors(model, params_only: bool = True, merged_to_cpu: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain HF name, tensor) of the merged model W + scale B A, in the order of the plain
    model's `named_parameters()` (`params_only`, tied weights once) or `state_dict()`.
    Adapted weights are new tensors (moved to the CPU one by one with `merged_to_cpu`, so an
    export holds no merged copy on the GPU); every other tensor is the live one (detached)."""
    layers = _lora_layers(model)
    base = model.get_base_model()
    items = base.named_parameters() if params_only else base.state_dict(keep_vars=True).items()
    for name, t in items:
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in layers and leaf == "weight":
            layer = layers[owner]
            merged = t.detach() + layer.get_delta_weight(ADAPTER).to(t.dtype)
            yield f"{owner}.weight", merged.to("cpu") if merged_to_cpu else merged
        else:
            yield _plain(name), t.detach()


def save_merged(model, base_dir: Path, out_dir: Path) -> None:
    """Write the merged model as a plain Hugging Face directory (config, safetensors, and the
    tokenizer files of `base_dir`) that `AutoModelForCausalLM.from_pretrained` loads."""
    state = dict(merged_tensors(model, params_only=False, merged_to_cpu=True))
    save_plain_model(state, copy.deepcopy(model.get_base_model().config), Path(base_dir), Path(out_dir))


def save_adapter(model, base_dir: Path, out_dir: Path, tokenizer: bool = True) -> None:
    """Write peft's adapter directory (adapter_config.json, adapter_model.safetensors) that
    `PeftModel.from_pretrained(<the base model>, out_dir)` loads, with the base model's
    tokenizer files beside it (`tokenizer`; a weight publication leaves them out: the servers
    keep the base model's tokenizer, and they can be megabytes where the adapter is not)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    if tokenizer:
        copy_tokenizer_files(base_dir, out_dir)


def merge_adapter_dir(adapter_dir: Path, base_dir: Path, out_dir: Path) -> None:
    """The plain Hugging Face model of `base_dir` with the adapter directory `adapter_dir` merged
    in (`save_merged`'s tensors), in the adapter's dtype: what `tandem export` makes of a published
    adapter version."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "pt") as st:
        dtype = st.get_tensor(next(iter(st.keys()))).dtype
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapter_dir, adapter_name=ADAPTER)
    save_merged(model, Path(base_dir), Path(out_dir))


def write_initial_adapter(settings: dict, base_dir: Path, out_dir: Path) -> Path:
    """Version 0 as peft's adapter directory: the adapters of `settings` on `base_dir`'s model,
    all zero, so the served model is exactly the base model. Generation servers start with it
    under the policy's adapter name (`--lora-paths`), so requests can name the adapter before the
    trainer publishes anything. The model is built on the meta device from its config alone
    (nothing of the base weights is read); only the adapters' tensors are made, in the base
    model's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = wrap(AutoModelForCausalLM.from_config(config, dtype=dtype), settings, seed=0)
    for name, p in list(model.named_parameters()):
        if ".lora_" in name:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            setattr(module, leaf, torch.nn.Parameter(torch.zeros(p.shape, dtype=dtype), requires_grad=False))
    model.peft_config[ADAPTER].base_model_name_or_path = str(base_dir)
    save_adapter(model, Path(base_dir), Path(out_dir), tokenizer=False)
    return Path(out_dir)
