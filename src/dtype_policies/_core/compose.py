"""Class composition: the classes this library puts in front of a torch
module's own class (the policy call core, quantized forwards).

A composed class keeps the original's name, module and qualname, so
`isinstance` checks, `repr` and `state_dict()` are unchanged; only
`type(module) is cls` checks see it. Swapping `module.__class__` touches no
parameter. Composed modules pickle and deep-copy as their original class plus
the same mixins.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class ComposedModule:
    """Base of every composed class."""

    _dp_original: type[torch.nn.Module]
    _dp_mixins: tuple[type, ...]

    def __reduce_ex__(self, protocol: int) -> Any:
        cls = type(self)
        return (_rebuild, (cls._dp_original, cls._dp_mixins), self.__dict__.copy())


_classes: dict[tuple, type] = {}


def composed_class(original: type[torch.nn.Module], mixins: tuple[type, ...]) -> type:
    """`original` with `mixins` in front (cached); `original` itself for no mixins."""
    if not mixins:
        return original
    key = (original, mixins)
    cls = _classes.get(key)
    if cls is None:
        namespace = {
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "_dp_original": original,
            "_dp_mixins": mixins,
        }
        for mixin in mixins:
            for name in getattr(mixin, "_dp_per_class", ()):
                namespace[name] = _own_copy(mixin.__dict__[name], original)
        cls = type(original.__name__, (*mixins, ComposedModule, original), namespace)
        _classes[key] = cls
    return cls


def _own_copy(function: types.FunctionType, original: type) -> types.FunctionType:
    """`function` with a code object of its own: `torch.compile` keeps compiled
    code per code object, so each composed class gets its own cache (as each
    module class's `forward` has) instead of all policied modules sharing one,
    which would hit dynamo's recompile limit after a few models."""
    code = function.__code__.replace(co_name=f"{function.__name__}_{original.__name__}")
    copy = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _rebuild(original: type, mixins: tuple[type, ...]) -> torch.nn.Module:
    return object.__new__(composed_class(original, mixins))


def original_class(module: torch.nn.Module) -> type[torch.nn.Module]:
    """The module's own class, without this library's mixins."""
    return original_of(type(module))


def original_of(cls: type) -> type:
    """`cls` without this library's mixins (itself when it is not composed)."""
    return cls._dp_original if issubclass(cls, ComposedModule) else cls


def mixins_of(module: torch.nn.Module) -> tuple[type, ...]:
    cls = type(module)
    return cls._dp_mixins if issubclass(cls, ComposedModule) else ()


def set_mixins(module: torch.nn.Module, mixins: tuple[type, ...]) -> None:
    """Puts exactly `mixins` (ordered by their `_dp_order`) in front of the
    module's own class, keeping a class that other code stacked on top of a
    composed class (FSDP2's `fully_shard` makes `FSDP<cls>(FSDPModule, cls)`)."""
    ordered = tuple(sorted(set(mixins), key=lambda mixin: mixin._dp_order))
    composed = composed_class(original_class(module), ordered)
    cls = type(module)
    if issubclass(cls, ComposedModule) and "_dp_original" not in cls.__dict__:
        composed = _restacked(cls, composed)
    module.__class__ = composed


_restacked_classes: dict[tuple[type, type], type] = {}


def _restacked(cls: type, composed: type) -> type:
    """`cls`, a class derived from a composed class by other code, rebuilt on
    `composed` instead (cached): its own namespace, the same other bases."""
    key = (cls, composed)
    result = _restacked_classes.get(key)
    if result is None:
        bases = tuple(
            _base_for(base, composed) if issubclass(base, ComposedModule) else base
            for base in cls.__bases__
        )
        namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        result = _restacked_classes[key] = type(cls.__name__, bases, namespace)
    return result


def _base_for(base: type, composed: type) -> type:
    if "_dp_original" in base.__dict__:
        return composed
    return _restacked(base, composed)
