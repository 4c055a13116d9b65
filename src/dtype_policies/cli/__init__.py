"""The command line: `dtype-policies demo | inspect | bench | advise`
(also `python -m dtype_policies`).

>>> from dtype_policies.cli import main
>>> main(["--version"])  # doctest: +ELLIPSIS
dtype-policies ...
0
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from dtype_policies._version import __version__
from dtype_policies.cli import advise_command, bench_command, demo, inspect_command
from dtype_policies.cli.options import VERBOSE_HELP
from dtype_policies.cli.targets import CLIError

COMMANDS = (demo, inspect_command, advise_command, bench_command)
SIGPIPE_EXIT = 141  # 128 + SIGPIPE: stdout's reader closed it


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="dtype-policies",
        description="Keras-style dtype policies for PyTorch: see what each precision "
        "costs and gives.",
    )
    root.add_argument("--version", action="store_true", help="print the version and exit")
    root.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    subparsers = root.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a command; returns the exit code (0 ok, 1 error, 2 bad arguments,
    3 `advise`'s budget missed, 130 interrupted, 141 stdout closed by its reader)."""
    root = parser()
    try:
        args = root.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.version:
        print(f"dtype-policies {__version__}")
        return 0
    if args.command is None:
        root.print_help()
        return 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe fails here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print("dtype-policies: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, unless --verbose
        if args.verbose:
            traceback.print_exc()
        message = str(e) if isinstance(e, CLIError) else f"{type(e).__name__}: {e}"
        first = message.strip().splitlines()[0] if message.strip() else type(e).__name__
        print(f"dtype-policies {args.command}: error: {first}", file=sys.stderr)
        return 1


def _stdout_closed() -> int:
    """The reader of stdout went away (`dtype-policies inspect ... | head`):
    the command ends quietly with 141, the status a shell reports for a
    process ended by SIGPIPE (as `ls | head` does), the rest of its output
    sent to devnull so that the interpreter's last flush fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a replaced sys.stdout)
        pass
    return SIGPIPE_EXIT


def entry_point() -> None:
    """The console script."""
    sys.exit(main())
