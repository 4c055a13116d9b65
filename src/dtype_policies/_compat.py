"""Differences between the supported torch versions (2.6 to current), in one place."""

from __future__ import annotations

import sys
import types
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


_FX_TRACE_FILE = None if FX_TRACE is None else FX_TRACE.__file__

# torch's signs that a tracer records the running code are process-wide
# flags: `is_compiling()` holds for the whole of any thread's compilation
# (torch 2.13: tens of seconds for a model), `is_exporting()` for an export's,
# and torch.fx's tracing flag for any thread's `symbolic_trace` or `make_fx`
# (every compilation's AOTAutograd). Read as they are, another thread's eager
# calls took the traced paths while a model compiled: int4 products 10-90x
# slower and other values, torch.func transforms unseen; a compiled graph
# that read the fx flag failed its guard and compiled again. The functions
# below read those flags only together with this thread's own evidence.


def compiling() -> bool:
    """Whether a compiler traces the code running in this thread: Dynamo
    (`torch.compile`, strict `torch.export`), or, within a compilation or an
    export, a tracer of this thread (AOTAutograd's, non-strict export's).
    `torch.compiler.is_compiling()` without the other threads' compilations.

    >>> compiling()
    False
    """
    if torch.compiler.is_dynamo_compiling():  # a constant for Dynamo: no guard
        return True
    return torch.compiler._is_compiling_flag and traced_in_this_thread()


def traced_in_this_thread() -> bool:
    """Whether a tracer records this thread's tensor operations: a fake
    tensor or `make_fx` proxy mode among this thread's dispatch modes, or
    torch.fx's tracer (`symbolic_trace`, `make_fx`) on this thread's stack.

    >>> traced_in_this_thread()
    False
    """
    keys = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(keys.FAKE) is not None:
        return True
    if torch._C._get_dispatch_mode(keys.PROXY) is not None:
        return True
    if FX_TRACE is None or not FX_TRACE._is_fx_tracing_flag:
        return False
    # a pre-dispatch proxy mode (torch.export's) or torch.fx's own tracer
    if torch._ops._get_dispatch_mode_pre_dispatch(keys.PROXY) is not None:
        return True
    return _fx_tracer_on_this_stack()


def _fx_tracer_on_this_stack() -> bool:
    """Whether `torch.fx.Tracer.trace` (every torch.fx tracer's, subclasses
    call it) runs in this thread: it alone sets torch.fx's tracing flag."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "trace" and code.co_filename == _FX_TRACE_FILE:
            return True
        frame = frame.f_back
    return False


def fx_tracing() -> bool:
    """Whether torch.fx's tracer (`symbolic_trace`, `make_fx`) traces in this
    thread: its flag, read only with this thread's evidence (never under
    Dynamo, whose graphs would guard on the process-wide flag).

    >>> fx_tracing()
    False
    """
    if torch.compiler.is_dynamo_compiling():
        return False
    return FX_TRACE is not None and FX_TRACE._is_fx_tracing_flag and _fx_tracer_on_this_stack()


def fx_symbolic_tracing() -> bool:
    """Whether `torch.fx` traces (`symbolic_trace`, `make_fx`) in this thread,
    outside a compiler."""
    return fx_tracing() and not compiling()


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


_is_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", _exporting_before_2_7)


def is_exporting() -> bool:
    """Whether `torch.export` (strict or not) traces the code running in
    this thread (`torch.compiler.is_exporting()` without other threads'
    exports).

    >>> is_exporting()
    False
    """
    if not _is_exporting():
        return False
    return torch.compiler.is_dynamo_compiling() or traced_in_this_thread()
