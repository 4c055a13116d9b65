"""Modules whose weights do not exist yet: created by their first call."""

from __future__ import annotations

import torch

from dtype_policies.layers.layer import Layer
from dtype_policies.layers.sequential import Sequential


def creates_weights_when_called(module: torch.nn.Module) -> bool:
    """A torch lazy module not initialized, or a Keras-style layer not built
    whose class builds something (a `Dropout` builds nothing).

    >>> from dtype_policies import layers
    >>> [creates_weights_when_called(m) for m in (layers.Dense(4), layers.Dropout(0.1))]
    [True, False]
    """
    uninitialized = getattr(module, "has_uninitialized_params", None)
    if callable(uninitialized) and uninitialized():
        return True
    if not (isinstance(module, Layer) and module.built is False):
        return False
    if isinstance(module, Sequential):  # built by its layers
        return any(creates_weights_when_called(layer) for layer in module.layers)
    return type(module).build is not Layer.build


def refuse_unbuilt(model: torch.nn.Module, action: str, why: str) -> None:
    """Raises `ValueError` naming the modules of `model` whose first call will
    create their weights (`why`: what goes wrong if `action` runs first)."""
    unbuilt = [
        name or "(model)"
        for name, module in model.named_modules()
        if creates_weights_when_called(module)
    ]
    if unbuilt:
        shown = ", ".join(repr(name) for name in unbuilt[:3])
        raise ValueError(
            f"{action}: {shown}{' and more' if len(unbuilt) > 3 else ''} not built yet: their "
            f"weights are created by the first call, {why}. Call the model once on an input "
            f"(or build(input_shape)) first. Nothing was changed."
        )
