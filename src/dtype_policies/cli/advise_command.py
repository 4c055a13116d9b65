"""`dtype-policies advise TARGET --inputs ... --max-error 0.02`: the precision
advisor (`dtype_policies.advise`) on a model factory."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from dtype_policies.advisor import DEFAULT_CANDIDATES, advise
from dtype_policies.advisor.errors import NoFloatingOutputs
from dtype_policies.advisor.runner import OBJECTIVES
from dtype_policies.cli import output
from dtype_policies.cli.input_specs import HELP as INPUTS_HELP
from dtype_policies.cli.input_specs import load_inputs
from dtype_policies.cli.options import SEED_RANGE, check_range, common_options
from dtype_policies.cli.output_paths import check_output_file
from dtype_policies.cli.targets import CLIError, build_model, is_checkpoint

BUDGET_MISSED = 3  # the exit code when even the advice exceeds --max-error

EPILOG = """examples:
  dtype-policies advise mymodels:mlp --inputs 32x1024 --max-error 0.02
  dtype-policies advise mymodels:tiny_llama --inputs input_ids=1x64:int64 \\
      --candidates int8,mixed_bfloat16 --objective memory --output map.json
  dtype-policies advise mymodels:tiny_llama --inputs mymodels:sample_batch --json

The map written by --output is a policy file: `dtype_policies.saving.load_policy`
reads it, `inspect TARGET --policy-map map.json` shows it; the measurements are
kept in it under "advice". The exit code is 3 when even the advice (float32
everywhere) exceeds --max-error: the results are printed and written all the same."""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "advise",
        parents=[common_options()],
        help="choose a precision per module under an error budget (measured here)",
        description="Measures each module's sensitivity, time per call and stored bytes "
        "under each candidate precision on this machine, picks the fastest (or smallest) "
        "policy map whose end-to-end error on the inputs stays within --max-error, and "
        "verifies it with the map applied. Prints the per-module table (or JSON); "
        "progress goes to stderr.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="'package.module:factory' (a model)")
    parser.add_argument("--inputs", nargs="+", metavar="SPEC", required=True, help=INPUTS_HELP)
    parser.add_argument(
        "--batches", type=int, default=1, help="random batches from shape SPECs (default 1)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"seed of the random batches, {SEED_RANGE[0]} to {SEED_RANGE[1]} (default 0)",
    )
    parser.add_argument(
        "--max-error",
        type=float,
        default=0.02,
        help="relative error of the outputs allowed, > 0 (default 0.02)",
    )
    parser.add_argument(
        "--candidates",
        default=",".join(DEFAULT_CANDIDATES),
        help="comma-separated candidate policies, e.g. int4,int8,mixed_bfloat16 (the "
        "default), int4/64, float8, gptq, awq, bfloat16; float32 is always allowed",
    )
    parser.add_argument(
        "--objective", choices=OBJECTIVES, default="latency", help="what to minimise"
    )
    parser.add_argument(
        "--output", metavar="FILE", help="write the map (a policy file, with the advice)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.max_error) or args.max_error <= 0:
        raise CLIError(f"--max-error must be a number > 0. Received: {args.max_error}")
    if args.batches < 1:
        raise CLIError(f"--batches must be >= 1. Received: {args.batches}")
    check_range("--seed", args.seed, *SEED_RANGE)
    candidates = [name.strip() for name in args.candidates.split(",") if name.strip()]
    if not candidates:
        raise CLIError("--candidates is empty; give e.g. int8,mixed_bfloat16")
    if is_checkpoint(args.target):
        raise CLIError("advise takes a 'package.module:factory' TARGET, not a checkpoint")
    if args.output is not None:  # a bad path fails now, not after measuring
        check_output_file(args.output, "--output")
    model = build_model(args.target)
    inputs = load_inputs(args.inputs, model, args.batches, args.seed)
    try:
        advice = advise(
            model,
            inputs,
            max_error=args.max_error,
            candidates=candidates,
            objective=args.objective,
            progress=not args.quiet,
        )
    except NoFloatingOutputs as e:  # its advice, `metric=`, is no option here
        raise CLIError(
            "the model's outputs hold no floating tensor to compare (the command measures "
            "the relative error of floating outputs): give a TARGET factory whose model "
            "returns them (e.g. the logits, not their argmax), or call "
            "dtype_policies.advise(model, inputs, metric=...) in Python"
        ) from e
    try:
        if args.json:
            output.print_json({"target": args.target, **advice.to_dict()})
        else:
            print(advice.table())
    finally:  # printed first, so a failed write loses no results; written if printing failed
        if args.output is not None:
            try:
                advice.save(args.output)
            except OSError as e:
                sys.stdout.flush()
                raise CLIError(
                    f"--output {args.output!r}: cannot write the map: {e.strerror or e}"
                ) from e
    if args.output is not None and not args.json:
        print(f"map written to {args.output}")
    if not advice.error <= advice.max_error:  # NaN is a miss too
        print(
            f"dtype-policies advise: the budget is not met: the advice measures an error of "
            f"{advice.error:.4g} > --max-error {advice.max_error:g} (float32 everywhere "
            f"measures {advice.baseline_error:.4g}: is the model deterministic?)",
            file=sys.stderr,
        )
        return BUDGET_MISSED
    return 0
