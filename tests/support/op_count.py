"""OpCount: how many times each aten op ran (forward and backward) inside a `with` block — for
tests that a path does not do some work at all (a division at temperature 1, a slice's
row-sized backward), which a value comparison cannot see."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
