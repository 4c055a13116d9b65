"""A one-time warning about float16 compute on CPU."""

from __future__ import annotations

import warnings

import torch

from dtype_policies._compat import compiling
from dtype_policies._core.products import native_half_products
from dtype_policies._cpu import processor


class CPUFloat16Warning(UserWarning):
    """float16 compute on a CPU tensor: correct, rarely faster than bfloat16 and
    often far slower (by CPU class); use bfloat16. Shown once per process;
    a program that means float16 on CPU silences it by its category.

    >>> import warnings
    >>> from dtype_policies import CPUFloat16Warning
    >>> warnings.filterwarnings("ignore", category=CPUFloat16Warning)
    >>> issubclass(CPUFloat16Warning, UserWarning)
    True
    >>> warnings.filters.pop(0)[2] is CPUFloat16Warning  # the filter above, removed
    True
    """


_warned = False


def warn_if_cpu_float16(device: torch.device) -> None:
    """Warns once per process when float16 compute is requested on CPU."""
    global _warned
    if _warned or device.type != "cpu" or compiling():
        return  # (a compiled call's trace cannot warn: its first eager call does)
    _warned = True
    info = processor()
    if native_half_products(torch.float16, info):
        detail = (
            f"this CPU ({info.name}) has native float16 products, but bfloat16 ones are "
            "as fast or faster and need no loss scaling"
        )
    else:
        detail = (
            f"this CPU ({info.name}) has no native float16 products: linear layers multiply "
            "in float32 on the float16 values (float32 speed, no gain), other ops run "
            "emulated float16, often far slower than float32"
        )
    warnings.warn(
        f"A float16 compute dtype is running on CPU tensors: {detail}. Use 'bfloat16' or "
        "'mixed_bfloat16' on CPU. This warning is shown once.",
        CPUFloat16Warning,
        stacklevel=4,
    )
