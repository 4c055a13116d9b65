"""Weight regularizers by their Keras names. A layer computes them on its
variables in the variable dtype (float32 under mixed precision).

>>> import torch
>>> from dtype_policies import regularizers
>>> regularizers.get("l2")(torch.ones(4))
tensor(0.0400)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dtype_policies import _registry


class Regularizer:
    """Base class: `regularizer(weight) -> scalar loss tensor`.

    >>> class SumOfWeights(Regularizer):
    ...     def __call__(self, weight):
    ...         return 1e-3 * weight.sum()
    >>> SumOfWeights()(torch.ones(10))
    tensor(0.0100)
    """

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {}


class L1L2(Regularizer):
    """`l1 * sum(|w|) + l2 * sum(w**2)`.

    >>> L1L2(l1=0.1, l2=0.01)(torch.tensor([1.0, -2.0]))
    tensor(0.3500)
    """

    def __init__(self, l1: float = 0.0, l2: float = 0.0) -> None:
        for name, value in (("l1", l1), ("l2", l2)):
            if value < 0:
                raise ValueError(f"`{name}` must be non-negative. Received: {name}={value}")
        self.l1, self.l2 = float(l1), float(l2)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        loss = weight.new_zeros(())
        if self.l1:
            loss = loss + self.l1 * weight.abs().sum()
        if self.l2:
            loss = loss + self.l2 * weight.square().sum()
        return loss

    def get_config(self) -> dict[str, Any]:
        return {"l1": self.l1, "l2": self.l2}


class L1(L1L2):
    """`l1 * sum(|w|)`.

    >>> L1(0.1)(torch.tensor([1.0, -2.0]))
    tensor(0.3000)
    """

    def __init__(self, l1: float = 0.01) -> None:
        super().__init__(l1=l1)

    def get_config(self):
        return {"l1": self.l1}


class L2(L1L2):
    """`l2 * sum(w**2)` (no factor 1/2, as in Keras).

    >>> L2(0.1)(torch.tensor([1.0, -2.0]))
    tensor(0.5000)
    """

    def __init__(self, l2: float = 0.01) -> None:
        super().__init__(l2=l2)

    def get_config(self):
        return {"l2": self.l2}


REGULARIZERS = {
    "l1": L1,
    "l2": L2,
    "l1_l2": functools.partial(L1L2, l1=0.01, l2=0.01),
    "L1": L1,
    "L2": L2,
    "L1L2": L1L2,
}


def get(identifier: Any) -> Any:
    """A regularizer from a name, a config dict or a callable; `None` stays `None`.

    >>> get("l1_l2").get_config()
    {'l1': 0.01, 'l2': 0.01}
    >>> get(None) is None
    True
    """
    return _registry.resolve(identifier, REGULARIZERS, "regularizer")


def serialize(regularizer: Any) -> Any:
    """The Keras dict of a regularizer (`get` reads it back).

    >>> serialize(L2(0.001))
    {'class_name': 'L2', 'config': {'l2': 0.001}}
    """
    return _registry.serialize(regularizer, REGULARIZERS)


__all__ = ["L1", "L1L2", "L2", "Regularizer", "get", "serialize"]
