"""Activation functions by their Keras names.

>>> import torch
>>> from dtype_policies import activations
>>> activations.get("relu")(torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import _registry


def linear(x: torch.Tensor) -> torch.Tensor:
    return x


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def relu6(x: torch.Tensor) -> torch.Tensor:
    return F.relu6(x)


def leaky_relu(x: torch.Tensor, negative_slope: float = 0.2) -> torch.Tensor:
    return F.leaky_relu(x, negative_slope)


def elu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return F.elu(x, alpha)


def selu(x: torch.Tensor) -> torch.Tensor:
    return F.selu(x)


def gelu(x: torch.Tensor, approximate: bool = False) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if approximate else "none")


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return F.hardsigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=axis)


def log_softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.log_softmax(x, dim=axis)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x)


def softsign(x: torch.Tensor) -> torch.Tensor:
    return F.softsign(x)


def exponential(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def mish(x: torch.Tensor) -> torch.Tensor:
    return F.mish(x)


ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": linear,
    "relu": relu,
    "relu6": relu6,
    "leaky_relu": leaky_relu,
    "elu": elu,
    "selu": selu,
    "gelu": gelu,
    "silu": silu,
    "swish": silu,
    "sigmoid": sigmoid,
    "hard_sigmoid": hard_sigmoid,
    "tanh": tanh,
    "softmax": softmax,
    "log_softmax": log_softmax,
    "softplus": softplus,
    "softsign": softsign,
    "exponential": exponential,
    "mish": mish,
}


def get(identifier: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation for a name or callable; `None` gives `linear`."""
    if identifier is None:
        return linear
    return _registry.resolve(identifier, ACTIVATIONS, "activation")


def serialize(activation: Callable) -> str:
    """The name of a built-in activation (or the `__name__` of a custom one)."""
    return _registry.serialize(activation, ACTIVATIONS)


__all__ = [
    "elu",
    "exponential",
    "gelu",
    "get",
    "hard_sigmoid",
    "leaky_relu",
    "linear",
    "log_softmax",
    "mish",
    "relu",
    "relu6",
    "selu",
    "serialize",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "softsign",
    "tanh",
]
