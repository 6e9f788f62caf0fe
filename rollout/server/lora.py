"""LoRA adapter directories merged into the served model: what `/load_lora_adapter`
(rollout/server/lora_routes.py) loads, e.g. `<exp>/weights/v<N>/` written by a run with
`trainer.lora.sync: adapter` (trainer/lora.py `save_adapter`: peft's adapter_config.json and
adapter_model.safetensors, a few MB where the merged model is the whole model).

The server keeps serving a plain model: loading an adapter sets every adapted Linear weight to
W0 + (alpha / r) B A, where W0 is that weight as it was before any adapter touched it (a copy is
kept the first time an adapter names it). Merging always starts from W0, never from the weights
served now, so applying v5 gives the same model whether the server applied v1..v4 before, skipped
them, or was restarted on the base model: each adapter version is the whole policy, not a
difference to the previous one. A plain (full or partial) update writes new W0s: the tensors it
sets are the base later adapters merge onto.

Everything is checked before the model is touched (`read_adapter`): the config is a plain LoRA
(no DoRA, no per-module rank or alpha, no extra trained modules), was trained on the model this
server loaded (`base_model_name_or_path`), and every tensor is the A or B of a served Linear
weight, with the rank and shapes that weight needs. peft's names are used as peft writes them
(`base_model.model.<module>.lora_A.weight`); peft itself is not needed, the merge is a matmul.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterError(ValueError):
    """An adapter directory that cannot be applied (rollout/server/weights.py re-raises it as a
    WeightError); the message names the file or tensor at fault."""


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class Adapter:
    """A validated adapter: per served weight name, its (A [r, in], B [out, r]); one scale."""
    source: str
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.pairs.values()), default=0)


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _config(root: Path, base_model: str) -> tuple[dict, float]:
    """adapter_config.json, checked; and the scale of B A."""
    path = root / ADAPTER_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r}, "
                           f"not LORA")
    trained_on = cfg.get("base_model_name_or_path")
    if not isinstance(trained_on, str) or not _same_model(trained_on, base_model):
        raise AdapterError(f"{path}: base_model_name_or_path {trained_on!r} is not the model this server "
                           f"loaded ({base_model!r}): the adapter was trained on another model")
    for key, plain in (("use_dora", False), ("fan_in_fan_out", False), ("rank_pattern", {}),
                       ("alpha_pattern", {}), ("modules_to_save", None)):
        value = cfg.get(key, plain)
        if value not in (plain, None, {}, [], False):
            raise AdapterError(f"{path}: {key}={value!r} is not supported (a plain LoRA only: the merge is "
                               f"W + alpha / r * B A)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"{path}: r={rank!r} and lora_alpha={alpha!r} must be a positive integer and number")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return cfg, scale


def read_adapter(model: torch.nn.Module, path: str | Path, base_model: str, tied: set[str] = frozenset()
                 ) -> Adapter:
    """Read and validate the adapter directory `path` against the served `model`, which was
    loaded from `base_model`; raise AdapterError naming what does not fit."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg, scale = _config(root, base_model)
    rank = cfg["r"]
    file = root / ADAPTER_WEIGHTS
    if not file.is_file():
        raise AdapterError(f"{root} holds {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    try:
        tensors = load_file(str(file))
    except Exception as e:
        raise AdapterError(f"cannot read {file}: {e}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{file}: tensor {key}: not a LoRA A or B weight "
                               f"(base_model.model.<module>.lora_A.weight / lora_B.weight)")
        halves.setdefault(m["module"], {})[m["ab"]] = t
    if not halves:
        raise AdapterError(f"{file} holds no adapter tensor")
    pairs = {}
    for module, ab in halves.items():
        name = f"{module}.weight"
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            layer = None
        if not isinstance(layer, torch.nn.Linear):
            raise AdapterError(f"{file}: tensor base_model.model.{module}.lora_A/B.weight: {module!r} is not a "
                               f"Linear module of the served model")
        if name in tied:
            raise AdapterError(f"{file}: tensor base_model.model.{module}.lora_*: {name} is tied to another "
                               f"weight; an adapter on it is not supported")
        for half in "AB":
            if half not in ab:
                raise AdapterError(f"{file}: base_model.model.{module}.lora_{half}.weight is missing "
                                   f"(its lora_{'B' if half == 'A' else 'A'} is there)")
        a, b = ab["A"], ab["B"]
        out_f, in_f = layer.weight.shape
        for half, t, want in (("A", a, (rank, in_f)), ("B", b, (out_f, rank))):
            if tuple(t.shape) != want or not torch.is_floating_point(t):
                raise AdapterError(f"{file}: tensor base_model.model.{module}.lora_{half}.weight: shape "
                                   f"{list(t.shape)} ({t.dtype}), expected {list(want)} (r={rank}, served "
                                   f"{name} is {[out_f, in_f]}), floating point")
        pairs[name] = (a, b)
    return Adapter(source=str(root), scale=scale, pairs=pairs)


class AdapterBase:
    """The served weights before any adapter (W0), for the weights adapters have touched."""

    def __init__(self):
        self.saved: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def apply(self, model: torch.nn.Module, adapter: Adapter) -> None:
        """Set every weight an adapter ever touched to W0 (+ this adapter's B A where it has one):
        the served model becomes exactly base + this adapter. W0 is kept where the weight is (on
        a GPU server, in GPU memory: only the adapted Linear weights), A and B are moved there,
        and the merge writes into the parameter in place."""
        live = dict(model.state_dict())
        for name in adapter.pairs:
            if name not in self.saved:
                self.saved[name] = live[name].detach().clone()
        for name, base in self.saved.items():
            target = live[name]
            if name not in adapter.pairs:
                target.copy_(base)
                continue
            a, b = adapter.pairs[name]
            a, b = a.to(target.device), b.to(target.device)
            if a.dtype == b.dtype == base.dtype == target.dtype:
                # One pass over the weight, no temporary of its size: W0 + scale * (B @ A).
                torch.addmm(base, b, a, alpha=adapter.scale, out=target)
            else:   # mixed dtypes: peft's delta (in float32 for half precision), added in float32
                delta = b.float() @ a.float() if a.dtype in (torch.float16, torch.bfloat16) else b @ a
                delta = (delta * adapter.scale).to(a.dtype)
                target.copy_((base.float() + delta.float()).to(target.dtype))

    def replaced(self, names) -> None:
        """A plain update wrote these tensors: they are the new W0 (nothing saved for them)."""
        for name in names:
            self.saved.pop(name, None)
