"""Keras's layer losses: `add_loss` inside a call, and which calls they
belong to.

The outermost layer call of a thread clears the losses of its layer and
every sublayer, then each call inside it adds to them: after a forward,
`layer.losses` holds every loss added during it, two calls of a shared
sublayer included (Keras's call context). A thread that never added a loss
skips the clearing walk. A forward recomputed by activation checkpointing
during a backward pass neither clears nor adds: its losses were taken by
the forward it repeats.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class _ThreadCalls(threading.local):
    def __init__(self) -> None:
        # The layers whose calls are running in this thread, outermost first.
        # A stack (not a flag): dynamo handles appends and pops of it.
        self.layers: list[Any] = []


_calls = _ThreadCalls()
_losses_added: list[bool] = []  # not empty once any layer added a loss


def _recomputing() -> bool:
    """Whether a backward pass is running in this thread: a layer called
    then is activation checkpointing's recomputation of a forward whose
    losses were taken already (or a call from a backward hook)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def checked_losses(loss: Any) -> list[torch.Tensor]:
    """The tensors of `loss` (a tensor or a nested structure of them) to
    keep: none while a backward pass recomputes a forward."""
    losses = tree_flatten(loss)[0]
    for value in losses:
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                "`add_loss()` can only be called from inside `build()` or `call()`, "
                f"on a tensor input. Received invalid value: {value!r}"
            )
    if losses and not _losses_added:
        _losses_added.append(True)
    return [] if losses and _recomputing() else losses


def call_with_losses(layer: Any, args: tuple, kwargs: dict) -> Any:
    """`layer._call(args, kwargs)`: the outermost layer call of its thread
    clears the losses of `layer` and its sublayers first."""
    layers = _calls.layers
    if not layers and _losses_added and not _recomputing():
        layer._clear_losses()
    layers.append(layer)
    try:
        return layer._call(args, kwargs)
    finally:
        layers.pop()
