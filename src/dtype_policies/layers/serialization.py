"""Layer (de)serialization: `serialize_layer`, `deserialize_layer`, `register_serializable`.

A serialized layer is `{"module", "class_name", "config", "registered_name"}`,
the Keras dict shape. Built-in layers are found by class name; custom layers
are registered with `register_serializable` or passed in `custom_objects`.

>>> from dtype_policies import layers
>>> config = layers.serialize_layer(layers.Dense(3, dtype="mixed_bfloat16", name="d"))
>>> config["class_name"], config["config"]["dtype"]["config"]
('Dense', {'name': 'mixed_bfloat16'})
>>> layers.deserialize_layer(config).dtype_policy
<DTypePolicy "mixed_bfloat16">
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from dtype_policies.policies import DTypePolicy, serialize

_REGISTRY: dict[str, type] = {}


def register_serializable(package: str = "Custom", name: str | None = None) -> Callable:
    """Class decorator registering a layer class as `"<package>>ClassName"`.

    >>> from dtype_policies import layers
    >>> @layers.register_serializable("MyPackage")
    ... class MyDense(layers.Dense):
    ...     pass
    >>> layers.serialize_layer(MyDense(2))["registered_name"]
    'MyPackage>MyDense'
    """
    if not isinstance(package, str) or ">" in package:
        raise ValueError(f"`package` must be a string without '>'. Received: {package!r}")

    def decorator(cls: type) -> type:
        key = f"{package}>{name or cls.__name__}"
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"'{key}' is already registered to {_REGISTRY[key]!r}.")
        _REGISTRY[key] = cls
        cast(Any, cls)._registered_name = key  # read back by `serialize_layer`
        return cls

    return decorator


BUILTIN_LAYERS: dict[str, type] = {}
"""This library's layer classes by name (filled by `dtype_policies.layers`)."""


def serialize_layer(layer: torch.nn.Module) -> dict[str, Any]:
    """The dict form of a layer (its class and `get_config()`).

    >>> from dtype_policies import layers
    >>> config = serialize_layer(layers.Dense(3, dtype="mixed_bfloat16", name="d"))
    >>> config["module"], config["class_name"], config["config"]["units"]
    ('dtype_policies.layers', 'Dense', 3)
    """
    if not hasattr(layer, "get_config"):
        raise TypeError(
            f"Cannot serialize {type(layer).__name__}: only layers with `get_config()` "
            "(dtype_policies.layers.Layer subclasses) can be serialized."
        )
    cls = type(layer)
    registered = cls.__dict__.get("_registered_name")
    config = {
        key: serialize(value) if isinstance(value, DTypePolicy) else value
        for key, value in cast(Any, layer).get_config().items()  # (it has one: checked above)
    }
    builtin = BUILTIN_LAYERS.get(cls.__name__) is cls
    return {
        "module": "dtype_policies.layers" if builtin else cls.__module__,
        "class_name": cls.__name__,
        "config": config,
        "registered_name": registered,
    }


def deserialize_layer(
    config: dict[str, Any], custom_objects: dict[str, type] | None = None
) -> torch.nn.Module:
    """Rebuilds a layer from `serialize_layer` output.

    >>> from dtype_policies import layers
    >>> dense = deserialize_layer(serialize_layer(layers.Dense(3, dtype="bfloat16")))
    >>> type(dense).__name__, dense.units, dense.dtype_policy
    ('Dense', 3, <DTypePolicy "bfloat16">)
    """
    if not isinstance(config, dict) or "class_name" not in config or "config" not in config:
        raise ValueError(
            f"A serialized layer is a dict with 'class_name' and 'config'. Received: {config!r}"
        )
    custom_objects = custom_objects or {}
    class_name, registered = config["class_name"], config.get("registered_name")
    cls = (
        custom_objects.get(registered or "")
        or custom_objects.get(class_name)
        or _REGISTRY.get(registered or "")
        or BUILTIN_LAYERS.get(class_name)
    )
    if cls is None:
        raise ValueError(
            f"Unknown layer class '{registered or class_name}'. Register it with "
            "`dtype_policies.saving.register_serializable()` or pass it in `custom_objects`."
        )
    return cast(Any, cls).from_config(config["config"])  # a layer class's classmethod
