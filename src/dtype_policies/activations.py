"""Activation functions by their Keras names (every name of
`keras.activations`), and Keras's `get`, `serialize` and `deserialize`.

>>> import torch
>>> from dtype_policies import activations
>>> activations.get("relu")(torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies import _activation_functions, _registry
from dtype_policies._activation_functions import (
    celu,
    elu,
    exponential,
    gelu,
    glu,
    hard_shrink,
    hard_sigmoid,
    hard_silu,
    hard_tanh,
    leaky_relu,
    linear,
    log_sigmoid,
    log_softmax,
    mish,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_shrink,
    softmax,
    softplus,
    softsign,
    sparse_plus,
    sparse_sigmoid,
    sparsemax,
    squareplus,
    tanh,
    tanh_shrink,
    threshold,
)

# Keras's aliases: the same function objects under a second name.
swish = silu
hard_swish = hard_silu

ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    name: function
    for name, function in vars(_activation_functions).items()
    if inspect.isfunction(function)
    and function.__module__ == _activation_functions.__name__
    and not name.startswith("_")
}
ACTIVATIONS.update(swish=silu, hard_swish=hard_silu)


def get(identifier: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation for a name, a serialized dict or a callable; `None`
    gives `linear`.

    >>> get("swish") is silu, get(None) is linear
    (True, True)
    """
    if identifier is None:
        return linear
    return _registry.resolve(identifier, ACTIVATIONS, "activation", factories=False)


def serialize(activation: Callable) -> str:
    """The name of a built-in activation (or the `__name__` of a custom one),
    as Keras writes it: an alias gives the function's own name.

    >>> serialize(relu), serialize(swish)
    ('relu', 'silu')
    """
    return _registry.serialize(activation, ACTIVATIONS)


def deserialize(config: Any, custom_objects: dict[str, Any] | None = None) -> Callable:
    """The activation a name or a Keras serialized dict names (Keras's
    `keras.activations.deserialize`), looked up in `custom_objects` first.

    >>> deserialize("hard_swish") is hard_silu
    True
    >>> keras_form = {"module": "builtins", "class_name": "function", "config": "gelu",
    ...               "registered_name": "function"}
    >>> deserialize(keras_form) is gelu
    True
    """
    return _registry.resolve(
        config, ACTIVATIONS, "activation", factories=False, custom_objects=custom_objects
    )


__all__ = [
    "celu",
    "deserialize",
    "elu",
    "exponential",
    "gelu",
    "get",
    "glu",
    "hard_shrink",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "linear",
    "log_sigmoid",
    "log_softmax",
    "mish",
    "relu",
    "relu6",
    "selu",
    "serialize",
    "sigmoid",
    "silu",
    "soft_shrink",
    "softmax",
    "softplus",
    "softsign",
    "sparse_plus",
    "sparse_sigmoid",
    "sparsemax",
    "squareplus",
    "swish",
    "tanh",
    "tanh_shrink",
    "threshold",
]
