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
import weakref
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import torch

if TYPE_CHECKING:
    ModuleMixin = torch.nn.Module
else:
    ModuleMixin = object
"""The base of the classes this library composes onto torch modules:
`object` at run time, `torch.nn.Module` for type checkers (the mixins' `self`
is always a module)."""


class ComposedModule:
    """Base of every composed class."""

    _dp_original: type[torch.nn.Module]
    _dp_mixins: tuple[type, ...]

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        cls = type(self)
        # `__getstate__` of a class stacked on top (torch's parametrized
        # class refuses to pickle) has its say.
        state = cast(Any, self).__getstate__()
        return (_rebuild, (cls._dp_original, cls._dp_mixins), state)


_classes: weakref.WeakKeyDictionary[type, dict[tuple[type, ...], weakref.ref[type]]] = (
    weakref.WeakKeyDictionary()
)
"""original -> mixins -> the composed class, held weakly: a class defined at
run time (by a factory, a notebook cell run again) goes with its last
module, and its composed classes with it."""


def composed_class(original: type[torch.nn.Module], mixins: tuple[type, ...]) -> type:
    """`original` with `mixins` in front (cached while a module or a caller
    holds it); `original` itself for no mixins."""
    if not mixins:
        return original
    by_mixins = _classes.get(original)
    if by_mixins is None:
        by_mixins = _classes[original] = {}
    known = by_mixins.get(mixins)
    cls = None if known is None else known()
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
        by_mixins[mixins] = weakref.ref(cls)
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
    """The module's own class, without this library's mixins (and without
    the class torch's `parametrize` puts on a parametrized module)."""
    cls = type(module)
    if not issubclass(cls, ComposedModule) and _parametrized_by_torch(module):
        return cls.__bases__[0]
    return original_of(cls)


def _parametrized_by_torch(module: torch.nn.Module) -> bool:
    """Whether `torch.nn.utils.parametrize` put its class on the module: it
    derives `Parametrized<cls>` from the module's class, holding the
    parametrized tensors' properties, and expects `__bases__[0]` to be the
    class to restore when the last parametrization goes (`parametrize.
    type_before_parametrizations`)."""
    parametrizations = module.__dict__.get("_modules", {}).get("parametrizations")
    return (
        isinstance(parametrizations, torch.nn.ModuleDict)
        and len(parametrizations) > 0
        and len(type(module).__bases__) == 1
    )


def original_of(cls: type) -> type:
    """`cls` without this library's mixins (itself when it is not composed)."""
    return cls._dp_original if issubclass(cls, ComposedModule) else cls


def mixins_of(module: torch.nn.Module) -> tuple[type, ...]:
    cls = type(module)
    return cls._dp_mixins if issubclass(cls, ComposedModule) else ()


def set_mixins(module: torch.nn.Module, mixins: tuple[type, ...]) -> None:
    """Puts exactly `mixins` (ordered by their `_dp_order`) in front of the
    module's own class, keeping a class that other code stacked on top of it
    on top: FSDP2's `fully_shard` makes `FSDP<cls>(FSDPModule, cls)`, torch's
    `parametrize` makes `Parametrized<cls>(cls)` and removes it again by
    `__bases__[0]`, before or after the mixins came."""
    ordered = tuple(sorted(set(mixins), key=lambda mixin: cast(Any, mixin)._dp_order))
    original = original_class(module)
    composed = composed_class(original, ordered)
    cls = type(module)
    if issubclass(cls, ComposedModule):
        if "_dp_original" not in cls.__dict__:
            composed = _restacked(cls, original, composed)
    elif cls is not original:  # torch's parametrized class on the module's own
        composed = _restacked(cls, original, composed)
    module.__class__ = composed


_restacked_classes: weakref.WeakKeyDictionary[type, weakref.WeakKeyDictionary[type, Any]] = (
    weakref.WeakKeyDictionary()
)
"""The class other code made -> the composed class it was rebuilt on -> a
weak reference to the class `_restacked` built (torch's `parametrize` makes
a class per module, whose properties hold the module: they go with it).
Each class built holds the class it was built from (`_dp_restacked_from`),
so that restacking back gives that very class."""


def _restacked(cls: type, original: type, composed: type) -> type:
    """`cls`, a class derived by other code from `original` or from a composed
    class of it, rebuilt on `composed` instead (cached): its own namespace,
    the same other bases. The class other code made itself when it stands on
    `composed` (a module given back its own class gets back the very
    `Parametrized<cls>` torch made for it)."""
    source = cls.__dict__.get("_dp_restacked_from", cls)
    bases = tuple(_base_for(base, original, composed) for base in source.__bases__)
    if bases == source.__bases__:
        return source
    by_composed = _restacked_classes.get(source)
    if by_composed is None:
        by_composed = _restacked_classes[source] = weakref.WeakKeyDictionary()
    known = by_composed.get(composed)
    result = None if known is None else known()
    if result is None:
        namespace = {
            k: v for k, v in source.__dict__.items() if k not in ("__dict__", "__weakref__")
        }
        namespace["_dp_restacked_from"] = source
        result = type(source.__name__, bases, namespace)
        by_composed[composed] = weakref.ref(result)
    return result


def _base_for(base: type, original: type, composed: type) -> type:
    if base is original or "_dp_original" in base.__dict__:
        return composed
    if issubclass(base, ComposedModule):
        return _restacked(base, original, composed)
    return base
