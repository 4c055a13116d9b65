"""The kernel/bias constructor arguments that Dense-like layers share."""

from __future__ import annotations

from typing import Any

from dtype_policies import constraints, initializers, regularizers

KERNEL_BIAS_ARGUMENTS = (
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "kernel_constraint",
    "bias_constraint",
)
_RESOLVERS = {
    "initializer": (initializers.get, initializers.serialize),
    "regularizer": (regularizers.get, regularizers.serialize),
    "constraint": (constraints.get, constraints.serialize),
}


def set_kernel_bias_arguments(layer: Any, **arguments: Any) -> None:
    """Resolves and stores `kernel_initializer`, ..., `bias_constraint` on `layer`."""
    for name in KERNEL_BIAS_ARGUMENTS:
        resolve, _ = _RESOLVERS[name.split("_", 1)[1]]
        setattr(layer, name, resolve(arguments[name]))


def kernel_bias_config(layer: Any) -> dict[str, Any]:
    """The serialized kernel/bias arguments of `layer`, for `get_config`."""
    return {
        name: _RESOLVERS[name.split("_", 1)[1]][1](getattr(layer, name))
        for name in KERNEL_BIAS_ARGUMENTS
    }


def add_kernel_and_bias(
    layer: Any, kernel_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None
) -> None:
    """Creates `layer.kernel` and `layer.bias` (or registers no bias) with the
    layer's initializers, regularizers and constraints."""
    layer.kernel = layer.add_weight(
        shape=kernel_shape,
        initializer=layer.kernel_initializer,
        regularizer=layer.kernel_regularizer,
        constraint=layer.kernel_constraint,
        name="kernel",
    )
    if bias_shape is None:
        layer.register_parameter("bias", None)
        return
    layer.bias = layer.add_weight(
        shape=bias_shape,
        initializer=layer.bias_initializer,
        regularizer=layer.bias_regularizer,
        constraint=layer.bias_constraint,
        name="bias",
    )
