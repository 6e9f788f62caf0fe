"""Every torch.distributed collective of the project goes through here (tensors on the group's device).

Why: NCCL takes only tensors on the current CUDA device; gloo takes CPU tensors. Code that is
developed and tested on gloo with CPU tensors therefore fails at its first collective on a GPU
cluster (issue 31: the trainer all-reduced its CPU step statistics in the NCCL group, `No
backend type associated with device type cpu`, at step 1 of every multi-rank or Megatron run).
So a caller never chooses the device: each function below moves the tensors to the group's
device (NCCL: `torch.cuda.current_device()`; gloo: where they are), runs the collective, and
leaves the result in the caller's own tensor, on the caller's device. Two checks keep it so:
tests/unit/foundation/test_collectives_rule.py fails on a collective called anywhere else in
the project's packages, and with `TANDEM_EMULATE_NCCL=1` (read here, only here) CPU runs refuse
tensors that did not pass through this module, as NCCL would (see `nccl_guard.py`).

A submodule, not exported from `services.protocol`: it imports torch, which most roles never
need. It lives in `services.protocol` because the trainer and the generation server (which
receives broadcast weights) both use it, and roles share nothing else.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tandem.services.protocol import nccl_guard

ReduceOp = dist.ReduceOp
# The one place the emulation switch is read: every process of a test run inherits it.
EMULATE_NCCL = os.environ.get("TANDEM_EMULATE_NCCL") == "1"
if EMULATE_NCCL:
    nccl_guard.install()


def group_device(group=None) -> torch.device:
    """The device a group's collectives take tensors on."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _placed(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (itself when already there), marked as placed for the NCCL emulation."""
    out = t if t.device == device else t.to(device)
    return nccl_guard.mark(out)


def all_reduce(t: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """In place on `t` (any device); returns `t`."""
    work = _placed(t, group_device(group))
    dist.all_reduce(work, op=op, group=group)
    if work is not t:
        t.copy_(work)
    return t


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In place on `t` (any device): `src`'s values everywhere; returns `t`."""
    work = _placed(t.contiguous(), group_device(group))
    dist.broadcast(work, src=src, group=group)
    if work is not t:
        t.copy_(work)
    return t


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Fills `parts` (one tensor per rank, like `t`) with every rank's `t`; returns `parts`."""
    device = group_device(group)
    work = [_placed(p, device) for p in parts]
    dist.all_gather(work, _placed(t.contiguous(), device), group=group)
    for p, w in zip(parts, work, strict=True):
        if w is not p:
            p.copy_(w)
    return parts


def send(t: torch.Tensor, dst: int, group=None) -> None:
    dist.send(_placed(t.contiguous(), group_device(group)), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Into `t` (any device); returns `t`."""
    work = _placed(t, group_device(group))
    dist.recv(work, src=src, group=group)
    if work is not t:
        t.copy_(work)
    return t


def broadcast_object_list(objs: list, src: int = 0, group=None) -> list:
    """Pickled objects: torch serialises them onto the group's device itself (NCCL: the current
    CUDA device, so `torch.cuda.set_device` must have been called, as the backends do)."""
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs


def all_gather_object(parts: list, obj, group=None) -> list:
    dist.all_gather_object(parts, obj, group=group)
    return parts


def barrier(group=None) -> None:
    dist.barrier(group=group)
