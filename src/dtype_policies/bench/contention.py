"""How much of the machine other processes took while a benchmark ran.

On a small machine one busy process on another core is enough to make the
figures lie: torch's OpenMP threads spin-wait for a thread that is not
running, and an eager model at 2 threads runs many times slower, while an
engine with its own thread pool loses less. `LoadWindow` reads the machine's
busy time (`/proc/stat`, time stolen by the hypervisor included) and this
process's own CPU time; the difference, over the wall time of all cores, is
the share of the machine other processes took during the window.

>>> window = LoadWindow()
>>> share = window.others_share()
>>> share is None or 0.0 <= share <= 1.0
True
"""

from __future__ import annotations

import os
import time

# Below this share of the machine, a window counts as quiet.
QUIET_SHARE = 0.05
# Windows shorter than this carry too few clock ticks to be read.
_MIN_WINDOW_S = 0.2


def _machine_busy_s() -> float | None:
    """Seconds all CPUs have been busy (or stolen by the hypervisor) since
    boot, or `None` where `/proc/stat` cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice;
    # guest time is already counted in user time.
    ticks = [int(value) for value in fields[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class LoadWindow:
    """A window from its creation (or `restart`) to each `others_share` call."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._wall = time.perf_counter()
        self._busy = _machine_busy_s()
        self._own = _own_cpu_s()

    def others_share(self) -> float | None:
        """The share of all cores (0 to 1) that other processes took since
        the window began; `None` when it cannot be read (no `/proc/stat`, or
        a window too short)."""
        busy = _machine_busy_s()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall < _MIN_WINDOW_S:
            return None
        others = (busy - self._busy) - (_own_cpu_s() - self._own)
        return min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


def wait_until_quiet(max_wait_s: float, probe_s: float = 1.0) -> bool:
    """Waits, probing `probe_s` at a time, until other processes take less
    than `QUIET_SHARE` of the machine; `False` if `max_wait_s` passed first
    (or the load cannot be read)."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        window = LoadWindow()
        time.sleep(probe_s)
        share = window.others_share()
        if share is None:
            return False
        if share < QUIET_SHARE:
            return True
        if time.perf_counter() >= deadline:
            return False
