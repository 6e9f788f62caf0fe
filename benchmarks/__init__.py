"""Benchmarks: each module's `main(quick)` prints a table and writes <name>.json into this run's
directory, benchmarks/runs/<time>/ (the committed benchmarks/results/ with `--record`)."""
