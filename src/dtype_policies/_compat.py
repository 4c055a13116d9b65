"""Differences between the supported torch versions (2.6 to current), in one place."""

from __future__ import annotations

from typing import Any

import torch

_MAJOR, _MINOR = (int(p) for p in torch.__version__.split(".")[:2])
TORCH_VERSION: tuple[int, int] = (_MAJOR, _MINOR)

# Strict `torch.export` before torch 2.13 (the oldest version measured
# without it) also runs module calls as plain Python on fake tensors, with
# `torch.compiler.is_compiling()` false (measured on 2.6).
STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS = TORCH_VERSION < (2, 13)


FX_TRACE: Any
try:  # the flag `torch.fx.symbolic_trace` (and `make_fx`) sets while it traces
    from torch.fx import _symbolic_trace as FX_TRACE

    FX_TRACE._is_fx_tracing_flag  # noqa: B018 - present on every supported version
except (ImportError, AttributeError):  # pragma: no cover
    FX_TRACE = None


def fx_symbolic_tracing() -> bool:
    """Whether `torch.fx` traces (`symbolic_trace`, `make_fx`) outside a compiler."""
    return (
        FX_TRACE is not None and FX_TRACE._is_fx_tracing_flag and not torch.compiler.is_compiling()
    )
