"""`python -m benchmarks [--quick|--record] [names...]`: run every benchmark one after another
(never in parallel: they share the machine's two cores and compare ratios within one run).

Results go to one directory of this run, `benchmarks/runs/<time>/`; `--record` writes the
committed `benchmarks/results/` instead (the figures the docs cite; see benchmarks/common.py).

A benchmark is a module of this folder with a `main(quick)` function; the others (`common`,
`script_path`, the `long_tail` and `growing_lengths` workloads) are helpers and are skipped.
Each benchmark also runs alone as `python -m benchmarks NAME`, `python -m benchmarks.NAME` or
`python benchmarks/NAME.py`.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

from benchmarks.common import add_output_flags, apply_output_flags, discard_tables, output_dir


def benchmark_names() -> list[str]:
    """Modules of this folder that are benchmarks (define `main`), in name order."""
    here = Path(__file__).parent
    names = []
    for m in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if m.name.startswith("_") or m.name in ("common", "script_path"):
            continue
        source = (here / f"{m.name}.py").read_text()
        if "\ndef main(" in source:
            names.append(m.name)
    return names


def main() -> int:
    known = benchmark_names()
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="Run benchmarks; each writes <name>.json into benchmarks/runs/<time>/ "
                                            "(benchmarks/results/ with --record).")
    add_output_flags(p)
    p.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(known)})")
    args = p.parse_args()
    apply_output_flags(p, args)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
    failed = []
    for name in args.names or known:
        print(f"\n=== benchmarks/{name}.py ===", flush=True)
        t0 = time.time()
        discard_tables()
        try:
            importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        except Exception as e:  # one broken benchmark must not hide the others' results
            print(f"benchmark {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
        print(f"({name}: {time.time() - t0:.1f}s)")
    if not args.quick and output_dir(create=False).exists():
        print(f"\nresults of this run: {output_dir(create=False)}" + ("" if args.record else " (not recorded)"))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
