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
    """The identity (Keras's default: no activation).

    >>> linear(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-1.,  0.,  2.])
    """
    return x


def relu(x: torch.Tensor) -> torch.Tensor:
    """`max(x, 0)`.

    >>> relu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0., 0., 2.])
    """
    return F.relu(x)


def relu6(x: torch.Tensor) -> torch.Tensor:
    """`min(max(x, 0), 6)`.

    >>> relu6(torch.tensor([-1.0, 3.0, 8.0]))
    tensor([0., 3., 6.])
    """
    return F.relu6(x)


def leaky_relu(x: torch.Tensor, negative_slope: float = 0.2) -> torch.Tensor:
    """`x` above 0, `negative_slope * x` below (Keras's default slope 0.2).

    >>> leaky_relu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.2000,  0.0000,  2.0000])
    """
    return F.leaky_relu(x, negative_slope)


def elu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`x` above 0, `alpha * (exp(x) - 1)` below.

    >>> elu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.6321,  0.0000,  2.0000])
    """
    return F.elu(x, alpha)


def selu(x: torch.Tensor) -> torch.Tensor:
    """The scaled ELU of self-normalizing networks.

    >>> selu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-1.1113,  0.0000,  2.1014])
    """
    return F.selu(x)


def gelu(x: torch.Tensor, approximate: bool = False) -> torch.Tensor:
    """The Gaussian error linear unit; `approximate=True`: its tanh approximation.

    >>> gelu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.1587,  0.0000,  1.9545])
    """
    return F.gelu(x, approximate="tanh" if approximate else "none")


def silu(x: torch.Tensor) -> torch.Tensor:
    """`x * sigmoid(x)` (Keras's `swish` too).

    >>> silu(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.2689,  0.0000,  1.7616])
    """
    return F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`.

    >>> sigmoid(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0.2689, 0.5000, 0.8808])
    """
    return torch.sigmoid(x)


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The piecewise-linear sigmoid: `clip(x / 6 + 0.5, 0, 1)`.

    >>> hard_sigmoid(torch.tensor([-4.0, 0.0, 1.5]))
    tensor([0.0000, 0.5000, 0.7500])
    """
    return F.hardsigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """The hyperbolic tangent.

    >>> tanh(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.7616,  0.0000,  0.9640])
    """
    return torch.tanh(x)


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Exponentials normalized to sum to 1 along `axis`.

    >>> softmax(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    tensor([0.2500, 0.2500, 0.2500, 0.2500])
    """
    return torch.softmax(x, dim=axis)


def log_softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """The logarithm of `softmax`, computed stably.

    >>> log_softmax(torch.tensor([0.0, 0.0]))
    tensor([-0.6931, -0.6931])
    """
    return torch.log_softmax(x, dim=axis)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`log(1 + exp(x))`.

    >>> softplus(torch.tensor([0.0, 20.0]))
    tensor([ 0.6931, 20.0000])
    """
    return F.softplus(x)


def softsign(x: torch.Tensor) -> torch.Tensor:
    """`x / (1 + |x|)`.

    >>> softsign(torch.tensor([-1.0, 0.0, 3.0]))
    tensor([-0.5000,  0.0000,  0.7500])
    """
    return F.softsign(x)


def exponential(x: torch.Tensor) -> torch.Tensor:
    """`exp(x)`.

    >>> exponential(torch.tensor([0.0, 1.0]))
    tensor([1.0000, 2.7183])
    """
    return torch.exp(x)


def mish(x: torch.Tensor) -> torch.Tensor:
    """`x * tanh(softplus(x))`.

    >>> mish(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([-0.3034,  0.0000,  1.9440])
    """
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
    """The activation for a name or callable; `None` gives `linear`.

    >>> get("swish") is silu, get(None) is linear
    (True, True)
    """
    if identifier is None:
        return linear
    return _registry.resolve(identifier, ACTIVATIONS, "activation", factories=False)


def serialize(activation: Callable) -> str:
    """The name of a built-in activation (or the `__name__` of a custom one).

    >>> serialize(relu), serialize(get("swish"))
    ('relu', 'silu')
    """
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
