"""Sub-commands this package adds to `tandem` (see launcher.cli)."""
from __future__ import annotations


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
