"""Differences between the supported torch versions (2.6 to current), in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_MAJOR, _MINOR = (int(p) for p in torch.__version__.split(".")[:2])
TORCH_VERSION: tuple[int, int] = (_MAJOR, _MINOR)

# Strict `torch.export` before torch 2.13 (the oldest version measured
# without it) also runs module calls as plain Python on fake tensors, with
# `torch.compiler.is_compiling()` false (measured on 2.6).
STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS = TORCH_VERSION < (2, 13)

# oneDNN's `qlinear_pointwise` takes int8 activations on 2.13 (the oldest
# version measured with them); 2.6's refuses them ("data type of input should
# be uint8"). The versions between are not measured: they keep uint8 ones.
ONEDNN_QLINEAR_TAKES_INT8_ACTIVATIONS = TORCH_VERSION >= (2, 13)

# Inductor's C++ wrapper compiles this library's graphs on 2.13 (the oldest
# version measured with it); 2.6's calls C shims its headers lack
# (`aoti_torch_cpu__int_mm`: a C++ compile error at a quantized model's first
# call). The versions between are not measured: they keep the Python wrapper.
CPP_WRAPPER_BY_DEFAULT = TORCH_VERSION >= (2, 13)


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


def _dynamo_traces_an_export() -> bool:
    """Whether Dynamo traces for `torch.export` (strict) rather than for
    `torch.compile`: Dynamo calls this function while it traces and takes
    its result as a constant (it is marked below, as
    `torch.compiler.assume_constant_result` marks one); false outside Dynamo."""
    from torch._dynamo import symbolic_convert

    translator = getattr(symbolic_convert.tls, "current_tx", None)
    return translator is not None and bool(translator.export)


# marked without importing Dynamo (importing this package does not load it)
_dynamo_traces_an_export._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _exporting_before_2_7() -> bool:
    """`torch.compiler.is_exporting()` for torch 2.6, which has none: while
    Dynamo traces, its own export flag; elsewhere `is_compiling`'s flag,
    which only `torch.export` sets while it runs a model's Python on fake
    tensors (non-strict, and the ATen stage of a strict one): `torch.compile`
    never runs the model's Python with it set, Dynamo reads it instead."""
    return _dynamo_traces_an_export() or torch.compiler._is_compiling_flag


is_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", _exporting_before_2_7)
"""Whether `torch.export` (strict or not) traces the running code."""
