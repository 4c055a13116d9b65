"""The dtype-policies benchmark suite: `python -m benchmarks --help`."""
