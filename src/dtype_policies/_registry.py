"""Name-based lookup shared by initializers, activations, regularizers and
constraints, reading and writing Keras 3's serialized forms."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

# Keras's form of a plain function: `serialize_keras_object(relu)` is
# {"module": "builtins", "class_name": "function", "config": "relu", ...}.
_FUNCTION = "function"


def _lookup(name: Any, registry: Mapping[str, Any], custom_objects: dict | None) -> Any:
    """The entry called `name`: a custom object first, then a registered name,
    then a registered object's `__name__` (`"GlorotUniform"`, `"silu"`)."""
    if not isinstance(name, str):
        return None
    for table in (custom_objects or {}, registry):
        if name in table:
            return table[name]
    names = {getattr(entry, "__name__", key): entry for key, entry in registry.items()}
    return names.get(name)


def resolve(
    identifier: Any,
    registry: Mapping[str, Any],
    kind: str,
    *,
    factories: bool = True,
    custom_objects: dict[str, Any] | None = None,
) -> Any:
    """Returns the object for `identifier`: `None`, a registered name, a Keras
    serialized dict (`{"class_name", "config", ...}`; `"module"` and
    `"registered_name"` read when present), or a callable (returned as is).

    With `factories` (initializers, regularizers, constraints) every registry
    entry is a class or function that makes the object, called with the
    config, and a class given as the identifier is instantiated, as Keras does;
    without (activations) the entry is the object itself."""
    if identifier is None:
        return None
    if isinstance(identifier, str):
        factory = _lookup(identifier, registry, custom_objects)
        if factory is None:
            raise ValueError(
                f"Unknown {kind} '{identifier}'. Expected one of {sorted(registry)}, "
                "a config dict or a callable."
            )
        return factory() if factories else factory
    if isinstance(identifier, dict):
        return _from_dict(identifier, registry, kind, factories, custom_objects)
    if factories and inspect.isclass(identifier):
        return identifier()
    if callable(identifier):
        return identifier
    raise TypeError(
        f"Could not interpret {kind} identifier {identifier!r}: expected a name, a "
        "config dict or a callable."
    )


def _from_dict(
    data: dict, registry: Mapping[str, Any], kind: str, factories: bool, custom_objects: dict | None
) -> Any:
    class_name = data.get("class_name")
    if class_name == _FUNCTION:
        entry = _lookup(data.get("config"), registry, custom_objects)
        entry = entry or _lookup(data.get("registered_name"), {}, custom_objects)
        if entry is None:
            raise ValueError(f"Unknown {kind} function in config {data!r}.")
        return entry
    factory = _lookup(class_name, registry, custom_objects) or _lookup(
        data.get("registered_name"), {}, custom_objects
    )
    if factory is None:
        raise ValueError(
            f"Unknown {kind} config {data!r}: its class_name is none of "
            f"{sorted(registry)} (pass `custom_objects` for a class of your own)."
        )
    if not factories:
        return factory
    config = data.get("config") or {}
    from_config = getattr(factory, "from_config", None)
    return from_config(config) if from_config is not None else factory(**config)


def serialize(obj: Any, registry: Mapping[str, Any], module: str | None = None) -> Any:
    """A JSON-friendly form of `obj`: its registered name, or Keras's class
    dict `{"module", "class_name", "config", "registered_name"}` (`module`
    the Keras namespace for this library's classes)."""
    if obj is None:
        return None
    for name, factory in registry.items():
        if factory is obj:
            return name
    if hasattr(obj, "get_config"):
        cls = type(obj)
        builtin = cls in registry.values()
        if module is None:
            return {"class_name": cls.__name__, "config": obj.get_config()}
        return {
            "module": module if builtin else cls.__module__,
            "class_name": cls.__name__,
            "config": obj.get_config(),
            "registered_name": None if builtin else cls.__name__,
        }
    return getattr(obj, "__name__", repr(obj))
