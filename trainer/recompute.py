"""Activation recompute chosen by memory, at the trainer's start (`trainer.recompute: auto`, the
Megatron backend's `trainer.megatron.recompute: auto`).

Why at the start and not in the config check: the memory a rank may use is known only on its
device. Why the plan's estimate: one formula (launcher/simulate/memory.py, `choose_recompute`)
decides here and is what `tandem plan` prints, so the decision a run takes is the one its plan
showed for the GPUs it names, and both are checked against the same measurement.

A model whose shape the estimate cannot read (not a Qwen2/Qwen3/Llama-like config.json) is not
recomputed under auto, as before auto existed, with a warning. The estimate is of the GPU path
(bf16 Megatron parameters; the CPU's Megatron path runs float32), which only a stand-in memory
makes the CPU decide on.

The device's memory: on CUDA, the free memory `torch.cuda.mem_get_info` reports plus what this
process's allocator already holds (a GPU shared with another process leaves less); on the CPU
nothing is finite, so auto means off. `TANDEM_DEVICE_MEMORY_BYTES` stands in for a device of that
size (the CPU's tests of the GPU's rule; on CUDA it can only lower the figure). Every rank takes
the smallest memory of all ranks, so all of them decide alike: Megatron's recompute re-runs a
layer's tensor-parallel collectives in the backward pass, which every rank of the group must run.
"""
from __future__ import annotations

import copy
import logging
import math
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ENV = "TANDEM_DEVICE_MEMORY_BYTES"


def device_memory(device: torch.device) -> tuple[float | None, str]:
    """(bytes this rank may use, where the figure comes from); None: not finite (the CPU)."""
    raw = os.environ.get(ENV, "").strip()
    cap = None
    if raw:
        try:
            cap = float(raw)
        except ValueError:
            cap = math.nan
        if not cap > 0:
            raise ValueError(f"{ENV}={raw!r}: must be a positive number of bytes")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        have = free + torch.cuda.memory_reserved(device)
        if cap is None or cap >= have:
            return float(have), f"{device}'s free memory"
    if cap is not None:
        return cap, ENV
    return None, "the CPU"


def agreed_memory(memory: float | None) -> float | None:
    """The smallest of every rank's memory (a collective when the job has several ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return memory
    from tandem.services.protocol import collectives

    t = torch.tensor([math.inf if memory is None else memory], dtype=torch.float64)
    collectives.all_reduce(t, op=dist.ReduceOp.MIN)
    low = float(t[0])
    return None if math.isinf(low) else low


def decide(cfg, model_dir, dp: int, device: torch.device, backend: str, alive: int = 1):
    """The RecomputeChoice of the TrainerConfig `cfg` on `backend` (the one being built, whatever
    `cfg.backend` says) for the model in `model_dir` on `device`, logged; `dp`: the data-parallel
    size (the distributed optimizer's shards), `alive`: the micro-batches a pipeline keeps at
    once. Every rank calls it (a collective)."""
    from tandem.launcher.config import ConfigError
    from tandem.launcher.simulate.hardware import load_model_shape
    from tandem.launcher.simulate.memory import RecomputeChoice, choose_recompute, recompute_setting

    if cfg.backend != backend:
        cfg = copy.copy(cfg)
        cfg.backend = backend
    setting, key = recompute_setting(cfg)
    memory, source = device_memory(device)
    memory = agreed_memory(memory)
    try:
        shape = load_model_shape("", str(model_dir))
    except ConfigError as e:   # a model of another kind: auto cannot predict, and stays off
        shape = None
        if setting == "auto" and memory is not None:
            log.warning("%s: auto cannot predict this model's memory (%s): off; set it to true if a "
                        "micro-batch does not fit", key, e)
    if shape is None:
        choice = RecomputeChoice(key, setting, setting is True, None, None, memory, source)
    else:
        choice = choose_recompute(cfg, shape, dp, memory, source, alive)
    if choice.on and choice.usable is not None and choice.with_ is not None and choice.with_ > choice.usable:
        log.warning("%s; even with recompute the rank is predicted above the usable memory: lower "
                    "trainer.max_tokens_per_mb or spread the model over more GPUs", choice.reason)
    else:
        log.info("%s", choice.reason)
    return choice


def resolved(obj, on: bool):
    """A copy of the config object `obj` (a TrainerConfig or MegatronConfig) with `recompute`
    the decision: the backends then read a plain bool."""
    out = copy.copy(obj)
    out.recompute = on
    return out


def pipeline_micro_batches(cfg, world: int) -> int:
    """The micro-batches of a minibatch the Megatron pipeline keeps alive at once, from the
    experiment config `cfg` (as `tandem plan` counts them); 1 without pipeline parallelism."""
    t = cfg.trainer
    if t.backend != "megatron" or t.pipeline_parallel == 1 or not hasattr(cfg, "simulate"):
        return 1
    from tandem.launcher.simulate.memory import alive_micro_batches

    return alive_micro_batches(cfg, max(1, world // (t.tensor_parallel * t.pipeline_parallel)))


def start_fields(backend) -> dict:
    """The trainer's start record's fields about recompute (rank 0 writes them)."""
    choice = getattr(backend, "recompute_choice", None)
    return {"recompute": choice.record() if choice is not None else None}
