"""Weight constraints by their Keras names.

Keras applies constraints after each optimizer update. Here, call
`layer.apply_constraints()` (it walks all sublayers) after `optimizer.step()`.

>>> import torch
>>> from dtype_policies import constraints
>>> constraints.get("non_neg")(torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies import _registry

_EPSILON = 1e-7


class Constraint:
    """Base class: `constraint(weight) -> projected weight`; the base returns
    the weight unchanged.

    >>> class Clip(Constraint):
    ...     def __call__(self, weight):
    ...         return weight.clamp(-1, 1)
    >>> Clip()(torch.tensor([-3.0, 0.5, 2.0]))
    tensor([-1.0000,  0.5000,  1.0000])
    """

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Constraint:
        """The constraint a `get_config()` dict describes.

        >>> MaxNorm.from_config({"max_value": 3.0, "axis": 1}).max_value
        3.0
        """
        return cls(**config)


class NonNeg(Constraint):
    """Negative entries become 0.

    >>> NonNeg()(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
    """

    def __call__(self, weight):
        return weight.clamp_min(0)


class MaxNorm(Constraint):
    """Slices along `axis` whose norm exceeds `max_value` scaled down to it.

    >>> MaxNorm(max_value=1.0)(torch.tensor([[3.0, 0.0], [4.0, 0.5]]))
    tensor([[0.6000, 0.0000],
            [0.8000, 0.5000]])
    """

    def __init__(self, max_value: float = 2, axis: int = 0) -> None:
        self.max_value, self.axis = max_value, axis

    def __call__(self, weight):
        norms = weight.norm(dim=self.axis, keepdim=True)
        desired = norms.clamp(0, self.max_value)
        return weight * (desired / (norms + _EPSILON))

    def get_config(self):
        return {"max_value": self.max_value, "axis": self.axis}


class UnitNorm(Constraint):
    """Every slice along `axis` scaled to norm 1.

    >>> UnitNorm()(torch.tensor([[3.0], [4.0]]))
    tensor([[0.6000],
            [0.8000]])
    """

    def __init__(self, axis: int = 0) -> None:
        self.axis = axis

    def __call__(self, weight):
        return weight / (weight.norm(dim=self.axis, keepdim=True) + _EPSILON)

    def get_config(self):
        return {"axis": self.axis}


class MinMaxNorm(Constraint):
    """Norms along `axis` moved into `[min_value, max_value]`, by `rate` of the way.

    >>> MinMaxNorm(min_value=1.0, max_value=2.0)(torch.tensor([[0.3], [0.4]]))
    tensor([[0.6000],
            [0.8000]])
    """

    def __init__(
        self, min_value: float = 0.0, max_value: float = 1.0, rate: float = 1.0, axis: int = 0
    ) -> None:
        self.min_value, self.max_value, self.rate, self.axis = min_value, max_value, rate, axis

    def __call__(self, weight):
        norms = weight.norm(dim=self.axis, keepdim=True)
        desired = self.rate * norms.clamp(self.min_value, self.max_value) + (1 - self.rate) * norms
        return weight * (desired / (norms + _EPSILON))

    def get_config(self):
        return {
            "min_value": self.min_value,
            "max_value": self.max_value,
            "rate": self.rate,
            "axis": self.axis,
        }


# Keras's lowercase spellings of the classes (`keras.constraints.max_norm` is `MaxNorm`).
max_norm, min_max_norm, non_neg, unit_norm = MaxNorm, MinMaxNorm, NonNeg, UnitNorm

CONSTRAINTS = {
    "non_neg": NonNeg,
    "max_norm": MaxNorm,
    "unit_norm": UnitNorm,
    "min_max_norm": MinMaxNorm,
    "constraint": Constraint,
}


def get(identifier: Any) -> Any:
    """A constraint from a name, a config dict, a class or a callable; `None`
    stays `None`.

    >>> get("max_norm").get_config()
    {'max_value': 2, 'axis': 0}
    >>> get({"class_name": "UnitNorm", "config": {"axis": 1}}).axis
    1
    """
    return _registry.resolve(identifier, CONSTRAINTS, "constraint")


def serialize(constraint: Any) -> Any:
    """The Keras dict of a constraint, as `keras.constraints.serialize` writes
    it (`get` and `deserialize` read it back).

    >>> serialize(MaxNorm(3.0))
    {'module': 'keras.constraints', 'class_name': 'MaxNorm', 'config': {'max_value': 3.0, \
'axis': 0}, 'registered_name': None}
    """
    return _registry.serialize(constraint, CONSTRAINTS, "keras.constraints")


def deserialize(config: Any, custom_objects: dict[str, Any] | None = None) -> Any:
    """The constraint a name or a Keras serialized dict describes (Keras's
    `keras.constraints.deserialize`), looked up in `custom_objects` first.

    >>> deserialize("non_neg")(torch.tensor([-1.0, 1.0]))
    tensor([0., 1.])
    """
    return _registry.resolve(config, CONSTRAINTS, "constraint", custom_objects=custom_objects)


__all__ = [
    "Constraint",
    "MaxNorm",
    "MinMaxNorm",
    "NonNeg",
    "UnitNorm",
    "deserialize",
    "get",
    "max_norm",
    "min_max_norm",
    "non_neg",
    "serialize",
    "unit_norm",
]
