"""`python -m benchmarks [--quick] [names...]`: run every benchmark one after another (never in
parallel: they share the machine's two cores and compare ratios within one run)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--quick", action="store_true")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    args = p.parse_args()
    here = Path(__file__).parent
    names = args.names or sorted(m.name for m in pkgutil.iter_modules([str(here)])
                                 if m.name not in ("common", "__main__"))
    failed = []
    for name in names:
        print(f"\n=== benchmarks/{name}.py ===", flush=True)
        t0 = time.time()
        try:
            importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        except Exception as e:  # one broken benchmark must not hide the others' results
            print(f"benchmark {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
        print(f"({name}: {time.time() - t0:.1f}s)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
