"""Progress of a long calibration: block i of n, elapsed, estimated remaining.

Shown on standard error when it is a terminal (one line, rewritten in
place), or always with `progress=True` (one line per block); never with
`progress=False`.

>>> import io
>>> stream = io.StringIO()
>>> clock = iter([0, 3, 9, 9]).__next__
>>> progress = CalibrationProgress("gptq", 2, enabled=True, stream=stream, clock=clock)
>>> progress.block_done(0); progress.block_done(1); progress.finish()
>>> print(stream.getvalue().strip())
gptq: block 1/2, 0:03 elapsed, ~0:03 remaining
gptq: block 2/2, 0:09 elapsed, ~0:00 remaining
gptq: calibrated 2 blocks in 0:09
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class CalibrationProgress:
    """Reports each finished block of a calibration.

    Args:
        label: What is calibrating (the mode).
        total: The number of blocks.
        enabled: `True`, `False`, or `None` (when `stream` is a terminal).
        stream: Where to write (standard error).
        clock: Seconds, monotonic (for tests).
    """

    def __init__(
        self,
        label: str,
        total: int,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = interactive if enabled is None else bool(enabled)
        self.in_place = interactive
        self.label, self.total, self.clock = label, total, clock
        self.start = clock()
        self.done = 0
        self._open_line = False

    def _write(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.in_place:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
            self._open_line = not final
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def block_done(self, index: int) -> None:
        """Block `index` (0-based) is planned."""
        self.done = index + 1
        elapsed = self.clock() - self.start
        remaining = elapsed / self.done * (self.total - self.done)
        self._write(
            f"{self.label}: block {self.done}/{self.total}, {_clock_text(elapsed)} elapsed, "
            f"~{_clock_text(remaining)} remaining"
        )

    def finish(self) -> None:
        elapsed = _clock_text(self.clock() - self.start)
        self._write(f"{self.label}: calibrated {self.done} blocks in {elapsed}", final=True)

    def interrupted(self, error: BaseException) -> None:
        """Ends the line after a failure or an interrupt (nothing was changed)."""
        self._write(
            f"{self.label}: stopped at block {self.done + 1}/{self.total} "
            f"({type(error).__name__}); the model is unchanged",
            final=True,
        )
