"""The casting machinery shared by layers and `apply_policy`.

* `cast_floating` casts the floating tensors of a nested call-argument structure.
* `AutocastScope` is the Keras variable-autocast scope: while one is active,
  reading a layer weight created with `autocast=True` gives it in the scope's
  dtype, cast once per scope.
* `warn_if_cpu_float16` warns (once per process) about float16 compute on CPU.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch


def _has_array_interface(value: Any) -> bool:
    return hasattr(value, "__array__") and not isinstance(value, (str, bytes))


# `Tensor.bfloat16()` and friends skip `Tensor.to`'s argument parsing: about
# 1 µs less per cast, which matters for small layers.
_CAST_METHODS = {
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
    torch.float32: torch.Tensor.float,
    torch.float64: torch.Tensor.double,
}


def cast_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, the fast way for the common float dtypes."""
    method = _CAST_METHODS.get(dtype)
    return method(x) if method is not None else x.to(dtype)


def cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """Casts every floating tensor in a nested structure to `dtype`.

    Lists, tuples (named ones included) and dicts are traversed. Arrays with an
    `__array__` method become tensors. Integer, bool and complex tensors,
    Python scalars, strings and `None` are returned unchanged. `dtype=None`
    only converts arrays.
    """
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
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
    if _has_array_interface(value) and not isinstance(value, (int, float, bool, complex)):
        return cast_floating(torch.as_tensor(value), dtype)
    return value


def cast_call_arguments(
    args: tuple, kwargs: dict[str, Any], dtype: torch.dtype | None
) -> tuple[tuple, dict[str, Any]]:
    """`cast_floating` over positional and keyword arguments."""
    return tuple(cast_floating(arg, dtype) for arg in args), {
        key: cast_floating(value, dtype) for key, value in kwargs.items()
    }


def first_tensor(value: Any, floating: bool = False) -> torch.Tensor | None:
    """The first tensor (the first floating one with `floating`) in a nested
    structure of call arguments, or `None`."""
    if isinstance(value, torch.Tensor):
        return value if not floating or value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (list, tuple)) or isinstance(value, dict):
        for item in items:
            found = first_tensor(item, floating)
            if found is not None:
                return found
    return None


def cast_inputs(
    args: tuple, kwargs: dict[str, Any], dtype: torch.dtype | None
) -> tuple[tuple, dict[str, Any]]:
    """`cast_call_arguments`, with a fast path for the common single tensor."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return cast_call_arguments(args, kwargs, dtype)
    x = args[0]
    if dtype is not None and x.dtype != dtype and x.is_floating_point():
        return (cast_tensor(x, dtype),), kwargs
    return args, kwargs


class AutocastScope:
    """While active, autocast weights read inside a layer are cast to `dtype`.

    `dtype=None` disables variable autocasting (used by layers that opt out).
    Casts are cached for the lifetime of the scope, so a weight read several
    times in one call is cast once.
    """

    __slots__ = ("_cache", "dtype")

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        """Drops the casts made in this scope (called when the scope exits)."""
        if self._cache:
            self._cache.clear()

    def cast(self, weight: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler deduplicates casts itself
            return cast_tensor(weight, self.dtype)
        cached = self._cache.get(id(weight))
        if cached is None:
            cached = cast_tensor(weight, self.dtype)
            self._cache[id(weight)] = cached
        return cached


_state = threading.local()


def current_scope() -> AutocastScope | None:
    """The autocast scope active in this thread, if any."""
    return getattr(_state, "scope", None)


def set_scope(scope: AutocastScope | None) -> AutocastScope | None:
    """Makes `scope` the active one and returns the previous scope."""
    previous = getattr(_state, "scope", None)
    _state.scope = scope
    return previous


def call_in_scope(
    call: Callable[..., Any], scope: AutocastScope | None, args: tuple, kwargs: dict
) -> Any:
    """`call(*args, **kwargs)` with `scope` active (`None`: as things are)."""
    if scope is None:
        return call(*args, **kwargs)
    previous = set_scope(scope)
    try:
        return call(*args, **kwargs)
    finally:
        set_scope(previous)
        scope.clear()


def scope_for_call(
    is_mixed: bool,
    autocast: bool,
    compute_dtype: torch.dtype | None,
    own_scope: AutocastScope | None,
) -> AutocastScope | None:
    """The autocast scope a module call must enter (`None`: keep the current one).

    At the top level, a module opens a scope only when it is mixed (its weights
    must be cast to its compute dtype). Inside another module's scope, one that
    opts out of autocasting or computes in a non-float dtype disables weight
    casting; one with a different compute dtype opens its own scope; otherwise
    the outer scope is kept (Keras's rules).
    """
    current = getattr(_state, "scope", None)
    if current is None:
        return own_scope if is_mixed else None
    if not autocast or compute_dtype is None:
        return None if current.dtype is None else AutocastScope(None)
    if current.dtype != compute_dtype:
        return AutocastScope(compute_dtype)
    return None


# Casts of weights up to this many elements are kept between calls (a few
# hundred KiB at most per module), which removes the per-call cast cost that
# dominates small layers. Larger weights are cast once per call.
SMALL_WEIGHT_CACHE_ELEMENTS = 65536


def cast_weight(
    cache: dict[str, tuple],
    name: str,
    weight: torch.Tensor,
    scope: AutocastScope | torch.dtype,
    keep_all: bool = False,
) -> torch.Tensor:
    """`weight` cast differentiably to the scope's dtype (or to a dtype given
    directly, by a leaf module that opens no scope).

    Small weights (all weights with `keep_all`) keep their cast in `cache`
    across calls until the weight changes (in place or replaced), or the grad
    or inference mode differs. Other weights are cast once per scope, or on
    every call when no scope is given.
    """
    dtype = scope if isinstance(scope, torch.dtype) else scope.dtype
    if torch.compiler.is_compiling() or (
        not keep_all and weight.numel() > SMALL_WEIGHT_CACHE_ELEMENTS
    ):
        if isinstance(scope, torch.dtype):
            return cast_tensor(weight, dtype)
        return scope.cast(weight)
    requires_grad = weight.requires_grad and torch.is_grad_enabled()
    entry = cache.get(name)
    if (
        entry is not None
        and entry[0] is weight
        and entry[1] == weight._version
        and entry[6] == weight.data_ptr()
        and entry[2] is dtype
        and entry[3] == requires_grad
        and entry[4] == torch.is_inference_mode_enabled()
    ):
        return entry[5]
    cast = cast_tensor(weight, dtype)
    cache[name] = (
        weight,
        weight._version,
        dtype,
        requires_grad,
        torch.is_inference_mode_enabled(),
        cast,
        weight.data_ptr(),
    )
    return cast


class LinearCastCache:
    """The compute-dtype casts of a linear layer's weight and bias, checked
    together in one step (the per-call cost that matters for small layers).

    Kept across calls while both tensors are unchanged and the grad and
    inference modes are the same; only for small weights unless `keep_all`.
    """

    __slots__ = ("_bias", "_key", "_weight", "casts")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight = self._bias = None
        self.casts: tuple = ()

    def get(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        keep_all: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if torch.compiler.is_compiling() or (
            not keep_all and weight.numel() > SMALL_WEIGHT_CACHE_ELEMENTS
        ):
            return cast_tensor(weight, dtype), None if bias is None else cast_tensor(bias, dtype)
        key = (
            weight._version,
            weight.data_ptr(),
            -1 if bias is None else bias._version,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            dtype,
        )
        if key == self._key and weight is self._weight and bias is self._bias:
            return self.casts
        self.casts = (
            cast_tensor(weight, dtype),
            None if bias is None else cast_tensor(bias, dtype),
        )
        self._key, self._weight, self._bias = key, weight, bias
        return self.casts

    def __deepcopy__(self, memo: dict) -> LinearCastCache:
        return LinearCastCache()  # casts made in grad mode are graph nodes, not state

    def __getstate__(self) -> None:
        return None

    def __setstate__(self, state: None) -> None:
        self.__init__()


class CPUFloat16Warning(UserWarning):
    """float16 compute on a CPU tensor: correct but very slow; use bfloat16."""


_warned_cpu_float16 = False


def warn_if_cpu_float16(device: torch.device) -> None:
    """Warns once per process when float16 compute is requested on CPU."""
    global _warned_cpu_float16
    if _warned_cpu_float16 or device.type != "cpu":
        return
    _warned_cpu_float16 = True
    warnings.warn(
        "A float16 compute dtype is running on CPU tensors. CPU float16 matrix "
        "products are orders of magnitude slower than float32 (about 2.5 GFLOP/s "
        "against 175 measured on an AVX-512 machine); use 'bfloat16' or "
        "'mixed_bfloat16' on CPU. This warning is shown once.",
        CPUFloat16Warning,
        stacklevel=3,
    )
