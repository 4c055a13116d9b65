"""`dtype-policies bench`: the benchmark suite (`dtype_policies.bench`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from dtype_policies.bench import runner, workloads
from dtype_policies.cli import output
from dtype_policies.cli.options import (
    CONTENDED_RETRIES_RANGE,
    THREADS_RANGE,
    check_range,
    common_options,
)
from dtype_policies.cli.output_paths import check_output_directory
from dtype_policies.cli.targets import CLIError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        parents=[common_options()],
        help="run the benchmark suite, print its tables, write JSON",
        description="Times every workload's variants (interleaved medians, ratios measured "
        "in one run against float32, whole-model bfloat16, torch.autocast, torchao and "
        "Keras where installed) and writes latest.json and latest.md.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument(
        "--workloads",
        metavar="A,B",
        default=",".join(workloads.WORKLOADS),
        help="comma-separated subset of: " + ", ".join(workloads.WORKLOADS),
    )
    parser.add_argument("--output", default=runner.DEFAULT_OUTPUT, help="results directory")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of every engine (default: 2, or 1 on one core)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    parser.add_argument(
        "--no-first-call", action="store_true", help="skip the LLM first-call processes"
    )
    parser.add_argument(
        "--variants",
        metavar="A,B",
        default=None,
        help="real-model workloads (smollm2, minilm): only these variants (and float32)",
    )
    parser.add_argument(
        "--speed-only",
        action="store_true",
        help="real-model workloads: time the variants without scoring their quality",
    )
    parser.add_argument(
        "--skip",
        metavar="A,B",
        default=None,
        help='real-model workloads: variants left out, patterns such as "gptq/*,awq/*"',
    )
    parser.add_argument(
        "--charts",
        metavar="DIR",
        default=None,
        help="real-model workloads: directory for the charts (default: --output)",
    )
    parser.add_argument(
        "--contended-retries",
        metavar="N",
        type=int,
        default=None,
        help="times a round is timed again after waiting for a quiet machine, when other "
        "processes took over 5%% of the CPU during it (default 2, 0 with --quick)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    selected = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(selected) - set(workloads.WORKLOADS))
    if unknown or not selected:
        raise CLIError(
            f"unknown workloads {unknown or [args.workloads]}; choose from "
            f"{sorted(workloads.WORKLOADS)}"
        )
    if args.threads is not None:
        check_range("--threads", args.threads, *THREADS_RANGE)
    if args.contended_retries is not None:
        check_range("--contended-retries", args.contended_retries, *CONTENDED_RETRIES_RANGE)
    check_output_directory(args.output, "--output")  # now, not after the run
    if args.charts is not None:
        check_output_directory(args.charts, "--charts")
    argv = ["--workloads", ",".join(selected), "--output", args.output]
    argv += ["--quick"] if args.quick else []
    argv += ["--threads", str(args.threads)] if args.threads is not None else []
    argv += ["--no-memory"] if args.no_memory else []
    argv += ["--no-first-call"] if args.no_first_call else []
    argv += ["--variants", args.variants] if args.variants else []
    argv += ["--speed-only"] if args.speed_only else []
    argv += ["--charts", args.charts] if args.charts is not None else []
    argv += ["--skip", args.skip] if args.skip else []
    if args.contended_retries is not None:
        argv += ["--contended-retries", str(args.contended_retries)]
    if not args.json:
        return runner.main(argv)
    with contextlib.redirect_stdout(sys.stderr):  # the tables go to stderr
        code = runner.main(argv)
    output.print_json(json.loads((Path(args.output) / "latest.json").read_text()))
    return code
