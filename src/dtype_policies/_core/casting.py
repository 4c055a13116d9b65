"""Casting the floating tensors among a call's arguments and outputs."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._compat import (
    STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS,
    compiling,
    fx_symbolic_tracing,
    fx_tracing,
    is_exporting,
)
from dtype_policies._derivatives import transform_active

# `Tensor.bfloat16()` and friends skip `Tensor.to`'s argument parsing: about
# half a microsecond less per cast, which matters for small layers. (Keyed by
# `dtype | None` so that `cast_tensor`'s lookup of `None` type-checks: it finds
# nothing and falls back to `x.to(None)`, `x` itself.)
_CAST_METHODS: dict[torch.dtype | None, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
    torch.float32: torch.Tensor.float,
    torch.float64: torch.Tensor.double,
}

HALF_DTYPES = (torch.bfloat16, torch.float16)


try:
    from torch._C._functorch import is_functorch_wrapped_tensor as functorch_wrapped
except ImportError:  # pragma: no cover - older torch

    def functorch_wrapped(tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a `torch.func` transform's wrapper (never, here)."""
        return False


def tracing() -> bool:
    """Whether a compiler or tracer records the ops (`torch.compile`, or one
    of the tracers of `exporting`): kept casts and opaque kernels are
    bypassed then, so that the recording holds the real computation."""
    if compiling() or torch._C._get_tracing_state() is not None:
        return True
    # (a non-strict or strict `torch.export` sets `is_compiling`; read on every call)
    if fx_tracing():
        return True
    return STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS and fake_tensor_mode_active()


def exporting() -> bool:
    """Whether a tracer records the ops for a program that runs without this
    library (`torch.export` and `torch.onnx.export`, `torch.jit.trace`,
    `torch.fx`): the products are then plain, exportable ATen ops (no
    private operators, no dtype views, no Python autograd functions, no
    branch on a size) with the eager path's values, rounding included.
    `torch.compile` alone (not exporting) may call this library's kernels."""
    if is_exporting() or torch._C._get_tracing_state() is not None:
        return True
    if torch.compiler.is_dynamo_compiling():  # `torch.compile`: Dynamo reads the code
        return False
    if fx_symbolic_tracing():
        return True
    return STRICT_EXPORT_RUNS_EAGER_ON_FAKE_TENSORS and fake_tensor_mode_active()


def fake_tensor_mode_active() -> bool:
    """Whether a `FakeTensorMode` is active (tensors carry no data)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def bfloat16_rounded(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to bfloat16's values, in float32 (nearest, ties to even);
    a gradient passes straight through the rounding.

    A cast there and back; under `torch.compile` (not exporting), the same
    rounding in integer ops: Inductor keeps the intermediate of a fused cast
    pair in float32 (it skips the rounding unless `emulate_precision_casts`
    is set), so compiled products that round their inputs to bfloat16
    differed from eager ones. Exported programs keep the cast pair (ONNX has
    no dtype views).

    >>> import torch
    >>> bfloat16_rounded(torch.tensor([1.00390625, 1.01171875])).tolist()  # ties to even
    [1.0, 1.015625]
    """
    return _rounded(x, torch.bfloat16, _bfloat16_in_integer_ops)


def _bfloat16_in_integer_ops(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)


def float16_rounded(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to float16's values, in float32 (nearest, ties to even;
    beyond float16's range, inf), as `bfloat16_rounded` is for bfloat16: in
    integer ops under `torch.compile`, where Inductor would skip the rounding
    of a fused cast pair.

    >>> import torch
    >>> float16_rounded(torch.tensor([1.0 + 2**-11, 65520.0, 2**-25 * 3])).tolist()
    [1.0, inf, 1.1920928955078125e-07]
    """
    return _rounded(x, torch.float16, _float16_in_integer_ops)


def _float16_in_integer_ops(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    normal = ((bits + (0xFFF + ((bits >> 13) & 1))) & -8192).view(torch.float32)
    subnormal = torch.round(x * 2.0**24) * 2.0**-24  # multiples of float16's smallest step
    rounded = torch.where(x.abs() < 2.0**-14, subnormal, normal)
    return torch.where(rounded.abs() > 65504.0, rounded * float("inf"), rounded)


def _rounded(
    x: torch.Tensor, dtype: torch.dtype, in_integer_ops: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`x` cast to `dtype` and back to float32; under `torch.compile` (not
    exporting) `in_integer_ops(x)`, the same values; NaN kept."""
    x = x.float()
    if not compiling() or exporting():
        rounded = x.to(dtype).float()
    else:
        rounded = torch.where(torch.isnan(x), x, in_integer_ops(x))
    return straight_through(x, rounded)


def float32_values(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 with exactly its own values: a bfloat16 or float16
    tensor through `bfloat16_rounded` / `float16_rounded`. Under
    `torch.compile`, a 16-bit activation a policy cast from float32 and a
    traced product reads back in float32 would otherwise be the unrounded
    float32 one: Inductor drops the fused cast pair's rounding (a per-token
    int8 rounding then put compiled outputs whole steps off eager's).

    >>> import torch
    >>> float32_values(torch.tensor([1.00390625]).bfloat16()).dtype
    torch.float32
    """
    in_integer_ops = _IN_INTEGER_OPS.get(x.dtype)
    if in_integer_ops is None or not compiling() or exporting():
        return x.float()  # exact
    return _rounded(x, x.dtype, in_integer_ops)


_IN_INTEGER_OPS = {torch.bfloat16: _bfloat16_in_integer_ops, torch.float16: _float16_in_integer_ops}


def bias_in(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`bias.to(dtype)`, to be added to an output of `dtype` with the values
    eager adds: a 16-bit bias by its own values, a float32 one rounded to a
    16-bit `dtype`. Under `torch.compile` (not exporting) both roundings are
    made in integer ops: Inductor fuses a cast into the add that follows it
    and skips the cast's rounding (compiled quantized products added a
    bfloat16 policy's bias unrounded, up to 0.06 off eager's output).

    >>> import torch
    >>> bias_in(torch.tensor([1.00390625]), torch.bfloat16).tolist()
    [1.0]
    """
    if not compiling() or exporting():
        return bias.to(dtype)
    return _bias_rounded_in_integer_ops(bias, dtype)


def _bias_rounded_in_integer_ops(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`bias_in` under `torch.compile`."""
    if bias.dtype in _IN_INTEGER_OPS:
        bias = float32_values(bias)
    in_integer_ops = _IN_INTEGER_OPS.get(dtype)
    if in_integer_ops is not None:
        bias = _rounded(bias, dtype, in_integer_ops)
    return bias.to(dtype)


def plus_bias(
    y: torch.Tensor, bias: torch.Tensor | None, *, materialized: bool = False
) -> torch.Tensor:
    """`y + bias` in `y`'s dtype with eager's roundings: the product `y` as
    its dtype holds it, the bias as `bias_in` gives it, one rounding of the
    sum. Under `torch.compile` (not exporting) Inductor fuses the add into
    the product's epilogue, on its float32 accumulators: the product's
    rounding is then written in integer ops, unless `materialized` says that
    `y` is the output of an operator Inductor calls (a native kernel's),
    already stored in its dtype (the integer ops cost a scalar pass over it:
    a 4096 x 1536 int4 product's epilogue took about as long as the product).

    >>> import torch
    >>> plus_bias(torch.ones(2, dtype=torch.bfloat16), torch.tensor([0.5, 2**-10])).tolist()
    [1.5, 1.0]
    """
    if bias is None:
        return y
    if not compiling() or exporting():
        return y + bias.to(y.dtype)
    if y.dtype in _IN_INTEGER_OPS and not materialized:
        y = float32_values(y).to(y.dtype)
    return y + _bias_rounded_in_integer_ops(bias, y.dtype)


def as_product_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, through `float32_values` when `dtype` is float32."""
    return float32_values(x) if dtype is torch.float32 else x.to(dtype)


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded`'s values with `x`'s derivative (the identity through a
    rounding) wherever one can be asked for: a tensor that requires
    gradients, forward mode, a `torch.func` transform (`transform_active`);
    `rounded` itself otherwise. (`x + (rounded - x)` is `rounded` exactly
    where `x` is finite: the two are within a factor of two of each other or
    the rounding is zero, so the difference is exact. An infinite `x` gives
    `rounded` as it is, with no derivative: `inf + (rounded - inf)` is NaN.)
    No derivative flows into `rounded`'s own computation: even a zero one
    came out NaN through a block's scale in Inductor's backward (int8
    training under `torch.compile` ended in NaN at its second step)."""
    if not x.requires_grad and not transform_active():
        return rounded
    rounded = rounded.detach()
    return torch.where(torch.isinf(x), rounded, x + (rounded - x).detach())


def cast_tensor(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`x.to(dtype)`, the fast way for the common float dtypes (`None`: `x`
    itself, as `x.to(None)`)."""
    method = _CAST_METHODS.get(dtype)
    return method(x) if method is not None else x.to(dtype)


def _has_array_interface(value: Any) -> bool:
    return (
        hasattr(value, "__array__")
        and not isinstance(value, (str, bytes, int, float, bool, complex))
        and not isinstance(value, torch.nn.Module)
    )


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """Casts every floating tensor in a nested structure to `dtype`.

    Lists, tuples (named ones included) and dicts are traversed. Arrays with an
    `__array__` method become tensors. Integer, bool and complex tensors,
    Python scalars, strings and `None` are returned unchanged. `dtype=None`
    only converts arrays.

    >>> import torch
    >>> cast_floating({"x": torch.ones(1), "ids": torch.ones(1, dtype=torch.long)},
    ...               torch.bfloat16)
    {'x': tensor([1.], dtype=torch.bfloat16), 'ids': tensor([1])}
    """
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.dtype != dtype and value.is_floating_point():
            return cast_tensor(value, dtype)
        return value
    if isinstance(value, (list, tuple)):
        cast = [cast_floating(item, dtype) for item in value]
        if isinstance(value, list):
            return cast
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*cast)
        return type(value)(cast)
    if isinstance(value, dict):
        return type(value)((key, cast_floating(item, dtype)) for key, item in value.items())
    if _has_array_interface(value):
        return cast_floating(torch.as_tensor(value), dtype)
    return value


def cast_inputs(
    args: tuple,
    kwargs: dict[str, Any],
    dtype: torch.dtype | None,
    forward: Callable[..., Any] | None = None,
) -> tuple:
    """`(args, kwargs)` with floating tensors cast to `dtype`; fast for the
    common single positional tensor. Additive masks are saturated, not
    rounded to -inf: keyword arguments named in `ADDITIVE_MASKS`, and the
    positional arguments `forward`'s signature names so (GPT-2's blocks get
    their mask by position)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        x = args[0]
        if dtype is not None and x.dtype != dtype and x.is_floating_point():
            return (cast_tensor(x, dtype),), kwargs
        return args, kwargs
    masks = additive_mask_positions(forward) if forward is not None and len(args) > 1 else ()
    return tuple(
        _saturated(arg, dtype) if index in masks else cast_floating(arg, dtype)
        for index, arg in enumerate(args)
    ), {
        key: _saturated(value, dtype) if key in ADDITIVE_MASKS else cast_floating(value, dtype)
        for key, value in kwargs.items()
    }


ADDITIVE_MASKS = frozenset(
    {
        "attention_mask",
        "attn_mask",
        "causal_mask",
        "encoder_attention_mask",
        "mask",
        # torch's nn.MultiheadAttention and nn.Transformer* (a float mask is additive)
        "key_padding_mask",
        "src_mask",
        "tgt_mask",
        "memory_mask",
        "src_key_padding_mask",
        "tgt_key_padding_mask",
        "memory_key_padding_mask",
    }
)
"""Keyword arguments that carry additive attention masks: a float32 mask's
`finfo(float32).min` rounds to -inf in bfloat16 (and much less to it in
float16), and a query whose every key is masked then becomes NaN in the
softmax, which spreads through the cache (`_saturated`)."""


# Weakly keyed by function (a bound method's, or an accelerate hook's
# partial, which holds its module): never read inside a compiled trace, whose
# guards on a cache filled as calls come would recompile its graphs.
_MASK_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def additive_mask_positions(forward: Callable[..., Any]) -> frozenset[int]:
    """The positions of `forward`'s (a bound method's) arguments whose names
    are in `ADDITIVE_MASKS`, once per function.

    >>> class Block(torch.nn.Module):
    ...     def forward(self, hidden, past=None, attention_mask=None): ...
    >>> sorted(additive_mask_positions(Block().forward))
    [2]
    """
    if compiling():
        return _mask_positions(forward)
    function = getattr(forward, "__func__", forward)
    try:
        return _MASK_POSITIONS[function]
    except KeyError:
        found = _MASK_POSITIONS[function] = _mask_positions(forward)
        return found
    except TypeError:  # not weakly referable: not kept
        return _mask_positions(forward)


def _mask_positions(forward: Callable[..., Any]) -> frozenset[int]:
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return frozenset()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return frozenset(
        index
        for index, parameter in enumerate(parameters)
        if parameter.kind in positional and parameter.name in ADDITIVE_MASKS
    )


def _saturated(value: Any, dtype: torch.dtype | None) -> Any:
    """`cast_floating(value, dtype)`, a floating tensor clamped to the
    narrower dtype's finite range first: its most negative value stays the
    most negative finite one."""
    if isinstance(value, torch.Tensor) and dtype is not None and value.dtype != dtype:
        limits = _narrower_range(value.dtype, dtype)
        if limits is not None:
            return cast_tensor(value.clamp(*limits), dtype)
    return cast_floating(value, dtype)


def _range_between(source: torch.dtype, target: torch.dtype) -> tuple[float, float] | None:
    if not (source.is_floating_point and target.is_floating_point):
        return None
    info = torch.finfo(target)
    return (info.min, info.max) if info.max < torch.finfo(source).max else None


_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Filled once, never written after: compiled graphs read it without a guard
# on its contents changing (a cache filled as calls come would recompile them).
_RANGES = {(a, b): _range_between(a, b) for a in _FLOATS for b in _FLOATS}


def _narrower_range(source: torch.dtype, target: torch.dtype) -> tuple[float, float] | None:
    """`target`'s finite range where it is narrower than floating `source`'s."""
    key = (source, target)
    return _RANGES[key] if key in _RANGES else _range_between(source, target)


def first_tensor(value: Any, floating: bool = False) -> torch.Tensor | None:
    """The first tensor (the first floating one with `floating`) in a nested
    structure of call arguments, or `None`."""
    if isinstance(value, torch.Tensor):
        return value if not floating or value.is_floating_point() else None
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return None
    for item in value:
        found = first_tensor(item, floating)
        if found is not None:
            return found
    return None
