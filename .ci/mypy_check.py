"""Runs mypy (configured in pyproject.toml) and compares its errors with a baseline.

The baseline, `.ci/mypy-baseline.txt`, lists the errors accepted today, one a
line, as `path: error: message  [code]` without line numbers, so that edits
elsewhere in a file do not change it. A line may repeat: each copy accepts one
error. The check fails on any error beyond the baseline. When errors go away it
passes and says how to shrink the baseline; it never grows:

    python .ci/mypy_check.py             # the check (CI)
    python .ci/mypy_check.py --shrink    # rewrite the baseline without fixed errors

`--shrink` refuses while there are new errors, so a new error is fixed (or
silenced with a `# type: ignore[code]` that names it), never baselined. The
baseline belongs to the mypy version pinned in the dev extra: the commit that
moves the pin deletes it and writes it again with `--create`, and its diff is
reviewed there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?):\d+(?::\d+)?: error: (?P<rest>.*)$")


def normalise(output: str) -> list[str]:
    """mypy's error lines without their line (and column) numbers, sorted;
    notes and the summary line are dropped."""
    errors = []
    for line in output.splitlines():
        match = _ERROR.match(line.strip())
        if match:
            errors.append(f"{match['path'].replace(chr(92), '/')}: error: {match['rest']}")
    return sorted(errors)


def run_mypy() -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    errors = normalise(completed.stdout)
    if completed.returncode not in (0, 1) or (completed.returncode == 1 and not errors):
        sys.stdout.write(completed.stdout)
        sys.stderr.write(completed.stderr)
        raise SystemExit(f"mypy itself failed (exit status {completed.returncode}).")
    return errors


def read_baseline() -> list[str]:
    if not BASELINE.exists():
        return []
    return [line for line in BASELINE.read_text().splitlines() if line and not line.startswith("#")]


def write_baseline(errors: list[str]) -> None:
    header = (
        "# mypy errors accepted for now, without line numbers (see .ci/mypy_check.py).\n"
        "# This list only shrinks: fix new errors instead of adding them here.\n"
    )
    BASELINE.write_text(header + "".join(f"{line}\n" for line in sorted(errors)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--shrink", action="store_true", help="drop fixed errors from the baseline")
    group.add_argument(
        "--create",
        action="store_true",
        help="write the baseline from scratch (only when there is none yet)",
    )
    args = parser.parse_args(argv)
    current = Counter(run_mypy())
    if args.create:
        if BASELINE.exists():
            raise SystemExit(f"{BASELINE.relative_to(ROOT)} exists; use --shrink.")
        write_baseline(list(current.elements()))
        print(f"Wrote {sum(current.values())} errors to {BASELINE.relative_to(ROOT)}.")
        return 0
    baseline = Counter(read_baseline())
    new = current - baseline
    fixed = baseline - current
    print(
        f"mypy: {sum(current.values())} errors, {sum(baseline.values())} in the baseline, "
        f"{sum(new.values())} new, {sum(fixed.values())} fixed."
    )
    if new:
        print("\nNew mypy errors (fix them; the baseline does not grow):")
        for line in sorted(new.elements()):
            print(f"  {line}")
        print("\nRun `python -m mypy` for their line numbers.")
        return 1
    if fixed:
        if args.shrink:
            write_baseline(list((baseline - fixed).elements()))
            print(f"Removed {sum(fixed.values())} fixed errors from the baseline.")
        else:
            print("\nThese baseline errors are gone:")
            for line in sorted(fixed.elements()):
                print(f"  {line}")
            print(
                "\nShrink the baseline with `python .ci/mypy_check.py --shrink` and commit "
                f"{BASELINE.relative_to(ROOT)}."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
