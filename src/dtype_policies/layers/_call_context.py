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

from dtype_policies._compat import compiling
from dtype_policies._derivatives import backward_running


class _ThreadCalls(threading.local):
    def __init__(self) -> None:
        # The layers whose calls are running in this thread, outermost first,
        # and the `training` each passes on. Stacks (not flags): dynamo
        # handles appends and pops of them.
        self.layers: list[Any] = []
        self.training: list[bool | None] = []


_calls = _ThreadCalls()
_losses_added: list[bool] = []  # not empty once any layer added a loss


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
    # a replayed forward's losses were taken by the forward it repeats
    return [] if losses and backward_running() else losses


_NOT_TAKEN = object()


def training_argument(cls: type) -> Any:
    """`(position, default)` of `cls.call`'s `training` argument (its index
    among the arguments after `self`, None when keyword-only; its default,
    None when it has none), or `_NOT_TAKEN` when it takes no `training`
    (Keras's test: a `call(x, **kwargs)` is not given it). A layer class
    keeps it as `_call_training_argument`, set when the class is made: a
    class attribute is a constant to a traced call, where a dictionary keyed
    by class is not traceable on every torch (2.6's Dynamo refuses a
    `WeakKeyDictionary`), and it lives exactly as long as its class."""
    parameters = list(inspect.signature(cls.call).parameters.values())  # type: ignore[attr-defined]
    found = _NOT_TAKEN
    for index, parameter in enumerate(parameters):
        if parameter.name == "training":
            default = None if parameter.default is inspect.Parameter.empty else parameter.default
            positional = parameter.kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
            found = (index - 1 if positional else None, default)
    return found


def call_in_context(layer: Any, args: tuple, kwargs: dict, training: bool | None) -> Any:
    """`layer._call(args, kwargs)` in the call context: `training` (the
    call's own, else the enclosing layer call's) reaches `call` if it takes
    it; the outermost layer call of its thread clears the losses of `layer`
    and its sublayers first."""
    calls = _calls
    layers = calls.layers
    # a call while a backward pass runs: a checkpoint's replay, or a hook's
    recomputing = backward_running()
    argument = layer._call_training_argument
    given = argument is not _NOT_TAKEN and argument[0] is not None and len(args) > argument[0]
    if given:
        training = args[argument[0]]  # passed by position: the caller's own
    if layers:
        if training is None:
            training = calls.training[-1]
    elif recomputing:
        # activation checkpointing replays a forward: with its `training`
        # (its thread's last forward's; else the last forward's of any
        # thread: a backward pass may run in another thread, a device's)
        records = layer.__dict__.get("_forward_training")
        if training is None and records is not None:
            training = records.get(threading.get_ident(), records.get(None))
    elif _losses_added:
        layer._clear_losses()
    if training is None and argument is not _NOT_TAKEN:
        training = argument[1]  # Keras: the signature's default, passed on too
    if not recomputing and not compiling():
        # what a replay finds (under no_grad too: a reentrant checkpoint's
        # forward runs so)
        records = layer.__dict__.get("_forward_training")
        if records is None and training is not None:  # (none kept until one has one)
            records = layer.__dict__["_forward_training"] = {}
        if records is not None:
            records[threading.get_ident()] = records[None] = training
    if training is not None and argument is not _NOT_TAKEN and not given:
        kwargs["training"] = training
    layers.append(layer)
    calls.training.append(training)
    try:
        return layer._call(args, kwargs)
    finally:
        layers.pop()
        calls.training.pop()
