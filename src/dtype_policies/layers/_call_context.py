"""Keras's call context: what the layer calls of one forward share.

`training`: a layer called with `training=` passes it on to the layers it
calls without one (a `Dropout` inside a custom layer called with
`training=False` drops nothing), as Keras's call context does; without it
anywhere, each layer follows its module's mode (torch's `train()` /
`eval()`). Activation checkpointing's replay of a forward, outside any
layer call, gets the `training` that forward had.

Losses: the outermost layer call of a thread clears the losses of its layer and
every sublayer, then each call inside it adds to them: after a forward,
`layer.losses` holds every loss added during it, two calls of a shared
sublayer included (Keras's call context). A thread that never added a loss
skips the clearing walk. A forward recomputed by activation checkpointing
during a backward pass neither clears nor adds: its losses were taken by
the forward it repeats.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class _ThreadCalls(threading.local):
    def __init__(self) -> None:
        # The layers whose calls are running in this thread, outermost first,
        # and the `training` each passes on. Stacks (not flags): dynamo
        # handles appends and pops of them.
        self.layers: list[Any] = []
        self.training: list[bool | None] = []


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


_TAKES_TRAINING: dict[type, bool] = {}


def takes_training(cls: type) -> bool:
    """Whether `cls.call` takes a `training` argument (or `**kwargs`)."""
    takes = _TAKES_TRAINING.get(cls)
    if takes is None:
        parameters = inspect.signature(cls.call).parameters.values()  # type: ignore[attr-defined]
        # Keras's test: a `call(x, **kwargs)` is not given `training`
        takes = _TAKES_TRAINING[cls] = any(p.name == "training" for p in parameters)
    return takes


def call_in_context(layer: Any, args: tuple, kwargs: dict, training: bool | None) -> Any:
    """`layer._call(args, kwargs)` in the call context: `training` (the
    call's own, else the enclosing layer call's) reaches `call` if it takes
    it; the outermost layer call of its thread clears the losses of `layer`
    and its sublayers first."""
    calls = _calls
    layers = calls.layers
    recomputing = _recomputing()
    if layers:
        if training is None:
            training = calls.training[-1]
    elif recomputing:
        # activation checkpointing replays a forward: with its `training`
        if training is None:
            training = layer.__dict__.get("_forward_training")
    elif _losses_added:
        layer._clear_losses()
    if not recomputing:
        layer.__dict__["_forward_training"] = training
    if training is not None and takes_training(type(layer)):
        kwargs["training"] = training
    layers.append(layer)
    calls.training.append(training)
    try:
        return layer._call(args, kwargs)
    finally:
        layers.pop()
        calls.training.pop()
