"""The options every command takes (`--verbose`), given to each command's
parser as an argparse parent so that they are accepted after the command
name too; and the ranges of the integer options torch takes (a seed, a
thread count), checked before torch overflows on them.

>>> from dtype_policies.cli import parser
>>> parser().parse_args(["inspect", "x:y", "--verbose"]).verbose
True
>>> parser().parse_args(["--verbose", "inspect", "x:y"]).verbose
True
"""

from __future__ import annotations

import argparse

from dtype_policies.cli.targets import CLIError

VERBOSE_HELP = "show tracebacks on errors"
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes (negatives alias these)
THREADS_RANGE = (1, 2**31 - 1)  # torch.set_num_threads takes a C int
CONTENDED_RETRIES_RANGE = (0, 100)  # each retry may wait a minute for a quiet machine


def common_options() -> argparse.ArgumentParser:
    """A parent parser holding the options every command takes. Their
    default is suppressed, so that a command's parser does not reset what
    the root parser read before the command name."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    return parent


def check_range(option: str, value: int, low: int, high: int) -> None:
    """Refuses `value` outside `low..high` (inclusive), naming `option`.

    >>> try:
    ...     check_range("--seed", -1, *SEED_RANGE)
    ... except CLIError as e:
    ...     print(e)
    --seed must be an integer from 0 to 18446744073709551615. Received: -1
    """
    if not low <= value <= high:
        raise CLIError(f"{option} must be an integer from {low} to {high}. Received: {value}")
