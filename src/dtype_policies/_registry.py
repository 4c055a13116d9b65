"""Name-based lookup shared by initializers, activations, regularizers and constraints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def resolve(
    identifier: Any, registry: dict[str, Callable], kind: str, *, factories: bool = True
) -> Any:
    """Returns the object for `identifier`: `None`, a registered name, a
    `{"class_name", "config"}` dict, or a callable (returned as is).

    With `factories` (initializers, regularizers, constraints) every registry
    entry is a class or function that makes the object, called with the
    config; without (activations) the entry is the object itself."""
    if identifier is None:
        return None
    if isinstance(identifier, str):
        try:
            factory = registry[identifier]
        except KeyError:
            raise ValueError(
                f"Unknown {kind} '{identifier}'. Expected one of {sorted(registry)}, or a callable."
            ) from None
        return factory() if factories else factory
    if isinstance(identifier, dict):
        class_name = identifier.get("class_name")
        names = {getattr(f, "__name__", name): f for name, f in registry.items()}
        factory = registry.get(class_name) or names.get(class_name)
        if factory is None:
            raise ValueError(f"Unknown {kind} config {identifier!r}.")
        return factory(**identifier.get("config", {})) if factories else factory
    if callable(identifier):
        return identifier
    raise TypeError(
        f"Could not interpret {kind} identifier {identifier!r}: expected a name, a "
        "config dict or a callable."
    )


def serialize(obj: Any, registry: dict[str, Callable]) -> Any:
    """A JSON-friendly form of `obj`: its registered name, or a class config dict."""
    if obj is None:
        return None
    for name, factory in registry.items():
        if factory is obj:
            return name
    if hasattr(obj, "get_config"):
        return {"class_name": type(obj).__name__, "config": obj.get_config()}
    return getattr(obj, "__name__", repr(obj))
