"""The convention every benchmark follows: a printed table and a flat JSON of headline figures."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpus": os.cpu_count(), "torch": torch_version, "python": platform.python_version(),
            "platform": platform.platform()}


def write_results(name: str, headline: dict) -> Path:
    """Write benchmarks/results/<name>.json: the headline figures plus machine and date."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    record = {**headline, "machine": machine(),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    out.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return out


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*[f"{v:,.3g}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)


def cli(main) -> None:
    """`python -m benchmarks.<name> [--quick]`."""
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the benchmark runs")
    main(quick=p.parse_args().quick)
