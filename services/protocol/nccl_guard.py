"""NCCL's device rule, emulated on CPU runs (gloo) for tests: `TANDEM_EMULATE_NCCL=1`.

Why: NCCL refuses a CPU tensor (`No backend type associated with device type cpu`); gloo takes
it. Without a GPU no test could see a collective that would fail on the cluster, which is how
the trainer's first GPU run died at step 1 (issue 31). `install()` (called by
`services.protocol.collectives` when the variable is set, and by nothing else) wraps
torch.distributed's tensor collectives so that a call made from the project's own code with a
CPU tensor that `collectives` did not place on the group's device raises, as NCCL would.

What is checked: calls whose caller is a module of the project's packages. Calls made by
megatron-core or by torch itself (its object collectives serialise onto the group's device on
their own) are not: on GPUs their tensors are the model's, already on CUDA. Every group counts
as NCCL while emulating (on GPUs the trainer's groups all are).
"""
from __future__ import annotations

import functools
import sys
import threading

import torch
import torch.distributed as dist

# The project's own code: the installed package and the benchmarks run from the checkout.
PROJECT_PACKAGES = ("tandem", "benchmarks")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
                      "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                      "all_to_all_single", "send", "recv", "isend", "irecv")

_state = threading.local()
_installed = False


def _marks() -> set[int]:
    if not hasattr(_state, "marks"):
        _state.marks = set()
    return _state.marks


def mark(t: torch.Tensor) -> torch.Tensor:
    """Record that `collectives` placed `t` for its next collective (a no-op unless installed)."""
    if _installed:
        _marks().add(id(t))
    return t


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _from_project(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name.split(".")[0] in PROJECT_PACKAGES


def _guarded(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        if _from_project(sys._getframe(1)):
            marks = _marks()
            for t in tensors:
                if t.device.type == "cpu" and id(t) not in marks:
                    raise RuntimeError(
                        f"NCCL would refuse this: torch.distributed.{name} got a CPU tensor "
                        f"{tuple(t.shape)} {t.dtype} that was not placed on the group's device "
                        "(NCCL: No backend type associated with device type cpu); call "
                        "services.protocol.collectives instead")
        for t in tensors:
            _marks().discard(id(t))
        return fn(*args, **kwargs)
    call.__wrapped_by_nccl_guard__ = True
    return call


def install() -> None:
    """Wrap torch.distributed's tensor collectives (idempotent)."""
    global _installed
    if _installed:
        return
    for name in TENSOR_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__wrapped_by_nccl_guard__", False):
            setattr(dist, name, _guarded(name, fn))
    _installed = True
