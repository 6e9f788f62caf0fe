"""Benchmarks: each module's `main(quick)` prints a table and writes benchmarks/results/<name>.json."""
