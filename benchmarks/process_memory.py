"""A process's peak memory, from `/proc/self` (Linux): the benchmarks that run
each case in a fresh process reset the peak when the case starts and read it
when it ends. No imports beyond the standard library, so that a peer's own
environment (`calibration_peer.py`) can use it too."""

from __future__ import annotations

from typing import Any


def status() -> dict[str, float]:
    """`VmHWM` (the peak RSS) and `VmRSS` in MB."""
    values = {}
    with open("/proc/self/status") as proc_status:
        for line in proc_status:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                values[key] = int(value.split()[0]) / 1024
    return values


def reset_peak() -> float:
    """Resets the peak RSS to the current RSS (where the kernel allows it);
    returns the current RSS in MB."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass
    return status()["VmRSS"]


def peak_since(base: float) -> float:
    """The peak RSS since `reset_peak` returned `base`, above it, in MB."""
    return status()["VmHWM"] - base


def touch(model: Any) -> None:
    """Reads every parameter and buffer of a torch module, so that weights
    memory-mapped from a checkpoint are resident before the peak is reset."""
    import torch

    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.sum()
