"""Building layers: the `build` wrapper every subclass gets, and the shapes a
first call passes to `build`."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch


def shape_of(value: Any) -> Any:
    """The shape(s) of a call argument: a tuple for a tensor or array, the same
    nesting for lists, tuples and dicts, `None` for anything else."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, dict):
        return {key: shape_of(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        shapes = [shape_of(item) for item in value]
        return type(value)(*shapes) if hasattr(value, "_fields") else type(value)(shapes)
    return None


def build_arguments(layer: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """The arguments a first call `layer(*args, **kwargs)` passes to `build`:
    the first input's shape, or one `<name>_shape` per `build` parameter
    named so (Keras's rule for layers with several inputs)."""
    parameters = [
        p
        for p in inspect.signature(layer.build).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    shape_names = [p.name for p in parameters if p.name.endswith("_shape")]
    if len(parameters) <= 1 or len(shape_names) < 2:
        first = args[0] if args else _first_call_argument(layer, kwargs)
        return ((shape_of(first),), {}) if parameters else ((), {})
    bound = inspect.signature(layer.call).bind_partial(*args, **kwargs).arguments
    shapes = {name: shape_of(bound.get(name[: -len("_shape")])) for name in shape_names}
    return (), shapes


def _first_call_argument(layer: Any, kwargs: dict[str, Any]) -> Any:
    """The value of `call`'s first parameter in a call made with keywords
    only (Keras builds with it), else the first keyword's."""
    first = next(iter(inspect.signature(layer.call).parameters.values()), None)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if first is not None and first.kind in positional and first.name in kwargs:
        return kwargs[first.name]
    return next(iter(kwargs.values()), None)


BUILD_LOCK = threading.RLock()
"""Held while a layer builds: two threads making the first call of one layer
build it once (the second waits, then finds it built)."""


def wrap_build(build: Callable) -> Callable:
    """Makes a subclass's `build` set up paths, policy and device, and run once."""

    @functools.wraps(build)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        with BUILD_LOCK:
            if self.built:
                return
            if self.__dict__.get("_building"):  # a subclass's build calling super().build()
                build(self, *args, **kwargs)
                return
            self._check_before_build()
            self.__dict__["_building"] = True
            try:
                self._assign_paths()
                self._refresh_policy_state()
                build(self, *args, **kwargs)
            finally:
                self.__dict__["_building"] = False
            self._finish_build()

    wrapped._dtype_policies_wrapped = True  # type: ignore[attr-defined]  # a marker on the function
    return wrapped
