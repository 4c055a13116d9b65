"""`python -m benchmarks [--quick] [--workloads a,b]`: the suite in
`dtype_policies.bench`, writing to `benchmarks/results/`.

`python -m benchmarks quality --model smollm2 --variants int4/32,int4/128`:
the real-model quality table of chosen variants only
(`dtype_policies.bench.realmodels.quality_table`).
"""

import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _with_output(arguments: list[str]) -> list[str]:
    if any(a == "--output" or a.startswith("--output=") for a in arguments):
        return arguments
    return [*arguments, "--output", str(RESULTS)]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["quality"]:
        from dtype_policies.bench.realmodels.quality_table import main as quality_main

        sys.exit(quality_main(_with_output(arguments[1:])))
    from dtype_policies.bench import main

    sys.exit(main(_with_output(arguments), prog="python -m benchmarks"))
