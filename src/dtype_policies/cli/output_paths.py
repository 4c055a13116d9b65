"""Checking where a command will write (`--output`, `--charts`) before it
measures anything, so that a bad path fails at once, not after the run.

>>> import pathlib, tempfile
>>> from dtype_policies.cli.output_paths import check_output_file
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> check_output_file(str(folder / "new" / "map.json"), "--output") == folder / "new" / "map.json"
True
>>> check_output_file(str(folder), "--output")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
dtype_policies.cli.targets.CLIError: --output '...' is a directory; give a file path ...
"""

from __future__ import annotations

import os
from pathlib import Path

from dtype_policies.cli.targets import CLIError


def check_output_file(path: str, option: str) -> Path:
    """The file `option` names, if it can be written: not empty, not a
    directory, and under a directory that exists or can be made, writable."""
    target = _not_empty(path, option, "a file path (e.g. map.json)")
    if target.is_dir():
        raise CLIError(f"{option} {path!r} is a directory; give a file path (e.g. map.json)")
    _check_parent(target.parent, path, option)
    return target


def check_output_directory(path: str, option: str) -> Path:
    """The directory `option` names, if it can be written in: not empty, not
    an existing file, and existing or creatable, writable."""
    target = _not_empty(path, option, "a directory path (e.g. benchmark-results)")
    if target.exists() and not target.is_dir():
        raise CLIError(f"{option} {path!r} is not a directory; give a directory path")
    _check_parent(target, path, option)
    return target


def _not_empty(path: str, option: str, wanted: str) -> Path:
    if not path.strip():
        raise CLIError(f"{option} is empty ({path!r}); give {wanted}")
    return Path(path)


def _check_parent(directory: Path, path: str, option: str) -> None:
    """The nearest existing ancestor of `directory` (which is made when
    missing) must be a directory this process can write in."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: making the directory fails
            raise CLIError(f"{option} {path!r}: '{existing}' is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{option} {path!r}: '{existing}' is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"{option} {path!r}: cannot write in '{existing}' (permission denied)")
