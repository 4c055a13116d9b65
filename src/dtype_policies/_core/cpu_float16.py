"""A one-time warning about float16 compute on CPU."""

from __future__ import annotations

import warnings

import torch


class CPUFloat16Warning(UserWarning):
    """float16 compute on a CPU tensor: correct but very slow; use bfloat16."""


_warned = False


def warn_if_cpu_float16(device: torch.device) -> None:
    """Warns once per process when float16 compute is requested on CPU."""
    global _warned
    if _warned or device.type != "cpu":
        return
    _warned = True
    warnings.warn(
        "A float16 compute dtype is running on CPU tensors. CPU float16 matrix "
        "products are orders of magnitude slower than float32 (about 2.5 GFLOP/s "
        "against 175 measured on an AVX-512 machine); use 'bfloat16' or "
        "'mixed_bfloat16' on CPU. This warning is shown once.",
        CPUFloat16Warning,
        stacklevel=4,
    )
