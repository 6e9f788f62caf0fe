"""New weights for a running model: from a Hugging Face directory, a LoRA adapter directory
(rollout/server/lora.py), or by torch.distributed broadcast.

Every path first gathers a complete, validated update (a `{name: tensor}` set, or an `Adapter`)
and only then copies it into the model, so a bad update (missing tensor, wrong shape, an adapter
for another model) leaves the served weights untouched. The broadcast path receives every
announced tensor even when some name is wrong, so the sender's collective never hangs on us.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.services.protocol.weight_group import join_weight_group, leave_weight_group

from . import expert_weights
from .lora import Adapter, AdapterBase, AdapterError, is_adapter_dir, read_adapter

log = logging.getLogger(__name__)


class WeightError(ValueError):
    """An update that cannot be applied; the message says which tensor or file is at fault."""


def expected_tensors(model) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _tied_names(model) -> set[str]:
    """Names that alias another parameter (e.g. lm_head.weight with tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:
            tied.add(name)
        else:
            seen[t.data_ptr()] = name
    return tied


def validate(model, state: dict[str, torch.Tensor], *, partial: bool = False) -> None:
    """Every model tensor present with its shape (unless `partial`), no unknown names."""
    want = expected_tensors(model)
    unknown = sorted(set(state) - set(want))
    if unknown:
        raise WeightError(f"unknown tensor names (not in the served model): {unknown[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise WeightError(f"tensor {name}: shape {list(t.shape)} != served {list(want[name].shape)}")
    if not partial:
        missing = sorted(set(want) - set(state) - _tied_names(model))
        if missing:
            raise WeightError(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def apply(model, update: dict[str, torch.Tensor] | Adapter, base: AdapterBase) -> None:
    """Copy a validated update into the model. `base` keeps the pre-adapter weights: an adapter
    merges onto them; plain tensors replace them (rollout/server/lora.py).

    The update's tensors may be anywhere (read from disk: CPU; received: the group's device);
    `copy_` writes them into the parameters in place, on the model's device and in its dtype, so
    the served tensors (and everything holding them, e.g. tied weights) stay where they are."""
    if isinstance(update, Adapter):
        base.apply(model, update)
        return
    want = expected_tensors(model)
    with torch.no_grad():
        for name, t in update.items():
            want[name].copy_(t)
    base.replaced(update)


def load_adapter(model, path: str, base_model: str) -> Adapter:
    """Read and validate a LoRA adapter directory for `/load_lora_adapter`: trained on
    `base_model` (the directory the server loaded at start), on untied Linear weights of `model`."""
    try:
        return read_adapter(model, path, base_model, _tied_names(model))
    except AdapterError as e:
        raise WeightError(str(e)) from None


def load_from_disk(model, model_path: str) -> dict[str, torch.Tensor]:
    """Read and validate the safetensors weights of a HF directory (sharded or not)."""
    from safetensors.torch import load_file
    root = Path(model_path)
    if not root.is_dir():
        raise WeightError(f"model_path {model_path!r} is not a directory")
    if is_adapter_dir(root):   # SGLang fails on it too: it is not a model
        raise WeightError(f"model_path {model_path!r} holds a LoRA adapter (adapter_config.json), not a model: "
                          f"load it with /load_lora_adapter")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightError(f"model_path {model_path!r} holds no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise WeightError(f"cannot read {f}: {e}") from None
    state = expert_weights.served(model, state, partial=False, error=WeightError)   # MoE: Hub names
    validate(model, state)
    return state


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightError(f"unknown dtype {name!r}")
    return dtype


class BroadcastGroup:
    """This server's membership in a trainer -> servers weight group (`/init_weights_update_group`).

    The sender is rank 0; this server is `rank_offset`. It joins with the shared rendezvous of
    `services.protocol.weight_group` (SGLang's contract: TCP store, keys prefixed by the group
    name), the one the trainer's sender uses, and receives on that group only, so the server
    never needs a default torch.distributed world. `nccl` is mapped to `gloo` when CUDA is
    absent: same code path, CPU wire.
    """

    def __init__(self):
        self.name: str | None = None
        self.pg = None

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str, timeout_s: float = 600.0) -> None:
        if self.name is not None:
            raise WeightError(f"weight update group {self.name!r} already exists; destroy it first")
        if backend == "nccl" and not torch.cuda.is_available():
            log.warning("backend nccl requested without CUDA; using gloo")
            backend = "gloo"
        self.pg = join_weight_group(master_address, master_port, rank=rank_offset, world_size=world_size,
                                    group_name=group_name, backend=backend, timeout_s=timeout_s)
        self.name = group_name
        log.info("joined weight update group %s as rank %d of %d (%s)", group_name, rank_offset, world_size, backend)

    def destroy(self, group_name: str) -> None:
        if self.name != group_name:
            raise WeightError(f"no weight update group named {group_name!r}")
        pg, self.pg, self.name = self.pg, None, None
        leave_weight_group(pg)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
                ) -> dict[str, torch.Tensor]:
        """Receive the announced tensors in order from rank 0 (blocking)."""
        from tandem.services.protocol import collectives
        if self.name != group_name:
            raise WeightError(f"no weight update group named {group_name!r}; call /init_weights_update_group")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        parsed = [parse_dtype(d) for d in dtypes]
        # Received on the group's device (NCCL: the current CUDA device, the model's: main.py
        # `resolve_device` makes it current; gloo: CPU), so NCCL needs no copy on the way in.
        device = collectives.group_device(self.pg)
        state = {}
        for name, dtype, shape in zip(names, parsed, shapes, strict=True):
            t = torch.empty(shape, dtype=dtype, device=device)
            collectives.broadcast(t, src=0, group=self.pg)
            state[name] = t
        return state
