"""Lets a benchmark run by its path, `python benchmarks/NAME.py`, import the checkout.

Python puts a script's own folder (`benchmarks/`) first on `sys.path`, not the checkout, so
`from benchmarks.common import ...` fails there with `ModuleNotFoundError: benchmarks`. Each
benchmark imports this module first when it has no package (that is, only when run by path):

    if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
        import script_path  # noqa: F401

`python -m benchmarks NAME` and `python -m benchmarks.NAME` need nothing: the working directory
(the checkout) is already on `sys.path`.
"""
from __future__ import annotations

import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)
