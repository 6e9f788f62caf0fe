"""The convention every benchmark follows: printed tables and a JSON of figures.

`benchmarks/results/<name>.json` holds the headline figures (flat keys), the machine and date,
and under `tables` every table the run printed, so any figure a doc quotes from a benchmark's
output is in a committed file (docs cite it; `tests/unit/foundation/test_doc_figures.py`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"

_printed: list[dict] = []     # tables printed since the last write_results, saved with it


def machine() -> dict:
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpus": os.cpu_count(), "torch": torch_version, "python": platform.python_version(),
            "platform": platform.platform()}


def write_results(name: str, headline: dict) -> Path:
    """Write benchmarks/results/<name>.json: the headline figures, the tables printed since the
    last call (`tables`), machine and date."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    record = {**headline, "tables": list(_printed), "machine": machine(),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    _printed.clear()
    out.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return out


def discard_tables() -> None:
    """Forget the tables printed so far (`python -m benchmarks` calls it before each benchmark, so
    a failed benchmark's tables never land in the next one's results)."""
    _printed.clear()


def _plain(v):
    """A JSON-able cell: numbers as they are (numpy ones too), anything else as printed."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int | float):
        return v
    try:
        return v.item()           # numpy scalars
    except AttributeError:
        return str(v)


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """Print a table and keep it for the next write_results."""
    _printed.append({"title": title, "columns": list(columns),
                     "rows": [[_plain(v) for v in r] for r in rows]})
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*[f"{v:,.3g}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)


def cli(main) -> None:
    """`python -m benchmarks.<name> [--quick]` or `python benchmarks/<name>.py [--quick]`."""
    module = sys.modules.get(main.__module__)
    p = argparse.ArgumentParser(description=module.__doc__ if module else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, to check the benchmark runs (writes no results)")
    main(quick=p.parse_args().quick)
