"""A policied module's call runs outside `torch.autocast`.

Its policy decides its dtypes, as an `autocast(enabled=False)` region does
inside an autocast one: under `torch.autocast`, a float32 island computes in
float32 and a `mixed_float16` module in float16. Code around the policied
modules (and a module without a policy called by none) keeps autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _autocast_devices() -> tuple[str, ...]:
    """The device types `torch.autocast` takes (torch < 2.7 has no list)."""
    listed = getattr(torch._C, "_autocast_supported_devices", None)
    if listed is not None:
        return tuple(listed())
    return tuple(  # torch 2.6's autocast device types
        device
        for device in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "privateuseone")
        if _known(device)
    )


def _known(device: str) -> bool:
    try:
        torch.is_autocast_enabled(device)
    except RuntimeError:
        return False
    return True


_AUTOCAST_DEVICES: tuple[str, ...] = _autocast_devices()


def autocast_active() -> bool:
    """Whether `torch.autocast` is enabled for any device type (one check;
    `torch.compile` folds it to a constant and guards on it)."""
    return torch._C._is_any_autocast_enabled()


def call_without_autocast(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` with `torch.autocast` disabled on every device
    type it is enabled on.

    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     call_without_autocast(torch.mm, torch.ones(2, 2), torch.ones(2, 2)).dtype
    torch.float32
    """
    enabled = tuple(device for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device))
    return _disabled_on(enabled, call, args, kwargs)


def _disabled_on(
    devices: tuple[str, ...], call: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    # nested `with` blocks, not an ExitStack: torch.compile traces these
    if not devices:
        return call(*args, **kwargs)
    with torch.autocast(devices[0], enabled=False):
        return _disabled_on(devices[1:], call, args, kwargs)
