"""`python -m benchmarks [--quick] [--workloads a,b]`: the suite in
`dtype_policies.bench`, writing to `benchmarks/results/`."""

import sys
from pathlib import Path

from dtype_policies.bench import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if not any(a == "--output" or a.startswith("--output=") for a in arguments):
        arguments += ["--output", str(Path(__file__).resolve().parent / "results")]
    sys.exit(main(arguments))
