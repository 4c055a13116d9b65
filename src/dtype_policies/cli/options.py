"""The options every command takes (`--verbose`), given to each command's
parser as an argparse parent so that they are accepted after the command
name too.

>>> from dtype_policies.cli import parser
>>> parser().parse_args(["inspect", "x:y", "--verbose"]).verbose
True
>>> parser().parse_args(["--verbose", "inspect", "x:y"]).verbose
True
"""

from __future__ import annotations

import argparse

VERBOSE_HELP = "show tracebacks on errors"


def common_options() -> argparse.ArgumentParser:
    """A parent parser holding the options every command takes. Their
    default is suppressed, so that a command's parser does not reset what
    the root parser read before the command name."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    return parent
