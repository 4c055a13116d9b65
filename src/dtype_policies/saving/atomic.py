"""Writing files atomically: a crash mid-write never leaves a partial file
under the final name."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Calls `write(temporary_path)`, flushes the file to disk and renames it
    to `path` (atomic on POSIX and Windows). On any error, or if the process
    dies first, `path` is untouched: the old file (if any) stays whole.

    >>> import pathlib, tempfile
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"
    >>> write_atomically(target, lambda tmp: pathlib.Path(tmp).write_text("hello"))
    >>> target.read_text()
    'hello'
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=directory)
    os.close(fd)
    try:
        write(temporary)
        # mkstemp makes the file private (0600): give it the mode a plain
        # `open()` would (the target's own when it exists)
        os.chmod(temporary, _mode_for(path))
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _mode_for(path: Path) -> int:
    """The permission bits of an existing `path`, else `0o666` less the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:  # elsewhere: set and restore (threads writing files meanwhile would see 0o22)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def _fsync_directory(directory: Path) -> None:
    """Makes the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
