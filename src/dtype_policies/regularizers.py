"""Weight regularizers by their Keras names. A layer computes them on its
variables in the variable dtype (float32 under mixed precision).

>>> import torch
>>> from dtype_policies import regularizers
>>> regularizers.get("l2")(torch.ones(4))
tensor(0.0400)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from dtype_policies import _registry

_EPSILON = 1e-7  # Keras's backend.epsilon()


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

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Regularizer:
        """The regularizer a `get_config()` dict describes.

        >>> L2.from_config(L2(0.5).get_config()).l2
        0.5
        """
        return cls(**config)


def _factor(value: Any, name: str) -> float:
    """A penalty factor as Keras accepts it: a finite non-negative number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isinf(value)
        or math.isnan(value)
        or value < 0
    ):
        raise ValueError(
            f"Invalid value for argument {name}: expected a non-negative float. "
            f"Received: {name}={value!r}"
        )
    return float(value)


class L1L2(Regularizer):
    """`l1 * sum(|w|) + l2 * sum(w**2)`.

    >>> L1L2(l1=0.1, l2=0.01)(torch.tensor([1.0, -2.0]))
    tensor(0.3500)
    """

    def __init__(self, l1: float | None = 0.0, l2: float | None = 0.0) -> None:
        self.l1 = _factor(0.0 if l1 is None else l1, "l1")
        self.l2 = _factor(0.0 if l2 is None else l2, "l2")

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

    def __init__(self, l1: float | None = 0.01) -> None:
        super().__init__(l1=0.01 if l1 is None else l1)

    def get_config(self):
        return {"l1": self.l1}


class L2(L1L2):
    """`l2 * sum(w**2)` (no factor 1/2, as in Keras).

    >>> L2(0.1)(torch.tensor([1.0, -2.0]))
    tensor(0.5000)
    """

    def __init__(self, l2: float | None = 0.01) -> None:
        super().__init__(l2=0.01 if l2 is None else l2)

    def get_config(self):
        return {"l2": self.l2}


class OrthogonalRegularizer(Regularizer):
    """`factor` times the mean absolute cosine between distinct rows
    (`mode="rows"`) or columns (`mode="columns"`) of a rank-2 weight, halved:
    0 when they are orthogonal.

    >>> OrthogonalRegularizer(factor=1.0)(torch.eye(3))
    tensor(0.)
    >>> OrthogonalRegularizer(factor=1.0)(torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    tensor(1.)
    """

    def __init__(self, factor: float = 0.01, mode: str = "rows") -> None:
        self.factor = _factor(factor, "factor")
        if mode not in ("rows", "columns"):
            raise ValueError(
                'Invalid value for argument `mode`. Expected one of {"rows", "columns"}. '
                f"Received: mode={mode}"
            )
        self.mode = mode

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.ndim != 2:
            raise ValueError(
                "Inputs to OrthogonalRegularizer must have rank 2. Received: "
                f"inputs.shape={tuple(weight.shape)}"
            )
        vectors = weight if self.mode == "rows" else weight.T
        # Keras's normalize: x * min(rsqrt(sum(x**2)), 1 / epsilon)
        inverse_norms = torch.rsqrt(vectors.square().sum(dim=1, keepdim=True))
        unit = vectors * inverse_norms.clamp(max=1.0 / _EPSILON)
        size = unit.shape[0]
        products = unit @ unit.T * (1.0 - torch.eye(size, dtype=unit.dtype, device=unit.device))
        pairs = size * (size - 1.0) / 2.0
        return self.factor * 0.5 * products.abs().sum() / pairs

    def get_config(self) -> dict[str, Any]:
        return {"factor": self.factor, "mode": self.mode}


# Keras's lowercase spellings of the classes (`keras.regularizers.l2` is `L2`).
l1, l2, l1_l2, orthogonal_regularizer = L1, L2, L1L2, OrthogonalRegularizer

REGULARIZERS = {
    "l1": L1,
    "l2": L2,
    # Keras documents the string "l1_l2" as l1=l2=0.01 (its own `get` rejects it)
    "l1_l2": functools.partial(L1L2, l1=0.01, l2=0.01),
    "l1l2": L1L2,
    "orthogonal_regularizer": OrthogonalRegularizer,
    "L1": L1,
    "L2": L2,
    "L1L2": L1L2,
    "OrthogonalRegularizer": OrthogonalRegularizer,
}


def get(identifier: Any) -> Any:
    """A regularizer from a name, a config dict, a class or a callable; `None`
    stays `None`.

    >>> get("l1_l2").get_config()
    {'l1': 0.01, 'l2': 0.01}
    >>> get(None) is None
    True
    """
    return _registry.resolve(identifier, REGULARIZERS, "regularizer")


def serialize(regularizer: Any) -> Any:
    """The Keras dict of a regularizer, as `keras.regularizers.serialize`
    writes it (`get` and `deserialize` read it back).

    >>> serialize(L2(0.001))
    {'module': 'keras.regularizers', 'class_name': 'L2', 'config': {'l2': 0.001}, \
'registered_name': None}
    """
    return _registry.serialize(regularizer, REGULARIZERS, "keras.regularizers")


def deserialize(config: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    """The regularizer a name or a Keras serialized dict describes (Keras's
    `keras.regularizers.deserialize`), looked up in `custom_objects` first.

    >>> deserialize({"module": "keras.regularizers", "class_name": "L1",
    ...              "config": {"l1": 0.5}, "registered_name": None}).l1
    0.5
    """
    return _registry.resolve(config, REGULARIZERS, "regularizer", custom_objects=custom_objects)


__all__ = [
    "L1",
    "L1L2",
    "L2",
    "OrthogonalRegularizer",
    "Regularizer",
    "deserialize",
    "get",
    "l1",
    "l1_l2",
    "l2",
    "orthogonal_regularizer",
    "serialize",
]
