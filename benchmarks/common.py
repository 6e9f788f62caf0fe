"""The convention every benchmark follows: printed tables and a JSON of figures.

`<name>.json` holds the headline figures (flat keys), the machine and date, and under `tables`
every table the run printed, so any figure a doc quotes from a benchmark's output is in a file.

Where it goes: by default into a directory of this run, `benchmarks/runs/<time>/` (ignored by
git), printed as `results: PATH`; the committed `benchmarks/results/` changes only with
`--record` (`python -m benchmarks --record`, or a benchmark's own `--record`). The docs cite the
committed files (`tests/unit/foundation/test_doc_figures.py`), so measuring one's own machine
never turns the suite red, and recording new figures is a deliberate act whose diff shows.
Plots and reports a benchmark keeps go the same way (`output_path`).
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

RESULTS = Path(__file__).parent / "results"     # the committed figures the docs cite
RUNS = Path(__file__).parent / "runs"           # one directory per unrecorded run (.gitignore)

_printed: list[dict] = []     # tables printed since the last write_results, saved with it
_record = False               # write into RESULTS (--record) instead of this run's directory
_run_dir: Path | None = None  # this process's directory under RUNS, made on first use


def set_recording(record: bool) -> None:
    """`--record`: later writes go to the committed benchmarks/results/."""
    global _record
    _record = record


def output_dir(create: bool = True) -> Path:
    """Where this run's files go: benchmarks/results/ when recording, else benchmarks/runs/<time>/
    (one directory for every benchmark of one `python -m benchmarks`); made on first write."""
    global _run_dir
    if _record:
        out = RESULTS
    else:
        if _run_dir is None or not _run_dir.is_relative_to(RUNS):
            _run_dir = RUNS / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = _run_dir
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


def output_path(filename: str) -> Path:
    """A file a benchmark keeps beside its JSON (a plot, a run's report), routed as the JSON is."""
    return output_dir() / filename


def read_results(name: str) -> tuple[dict, Path] | None:
    """Another benchmark's figures: this run's `<name>.json` if it wrote one, else the committed
    one; None when neither exists."""
    for path in (output_dir(create=False) / f"{name}.json", RESULTS / f"{name}.json"):
        if path.exists():
            return json.loads(path.read_text()), path
    return None


def machine() -> dict:
    gpu = None
    try:
        import torch
        torch_version = torch.__version__
        if torch.cuda.is_available():   # a figure measured on a GPU says which
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        torch_version = None
    return {"cpus": os.cpu_count(), "torch": torch_version, "python": platform.python_version(),
            "platform": platform.platform(), **({"gpu": gpu} if gpu else {})}


def write_results(name: str, headline: dict) -> Path:
    """Write <name>.json into `output_dir()` (this run's directory, or benchmarks/results/ with
    --record): the headline figures, the tables printed since the last call (`tables`), machine
    and date. Prints where."""
    out = output_path(f"{name}.json")
    record = {**headline, "tables": list(_printed), "machine": machine(),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    _printed.clear()
    out.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    print(f"results: {_shown(out)}" + ("" if _record else " (not recorded; --record writes benchmarks/results/)"),
          flush=True)
    return out


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def keep_tables(tables: list[dict]) -> None:
    """Tables of an earlier record to write again with the next write_results, as they were: a
    benchmark that re-records only part of its results (benchmarks/simulator.py --only) keeps
    the rest."""
    _printed[:0] = list(tables)


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


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """`--quick` and `--record`, the same for `python -m benchmarks` and each benchmark alone."""
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, to check the benchmark runs (writes no results)")
    p.add_argument("--record", action="store_true",
                   help="write the committed benchmarks/results/ (the figures the docs cite) instead of "
                        "this run's directory under benchmarks/runs/")


def apply_output_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick and args.record:
        p.error("--record with --quick: a quick run writes no results, so there is nothing to record")
    set_recording(args.record)


def cli(main, add_args=None) -> None:
    """`python -m benchmarks.<name> [--quick|--record]` or `python benchmarks/<name>.py [...]`.
    `add_args(parser)` adds a benchmark's own options and returns their names, passed to main."""
    module = sys.modules.get(main.__module__)
    p = argparse.ArgumentParser(description=module.__doc__ if module else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_flags(p)
    own = add_args(p) if add_args else []
    args = p.parse_args()
    apply_output_flags(p, args)
    main(quick=args.quick, **{k: getattr(args, k) for k in own})
