"""Listeners told when a model's policies or quantization change.

The lower layers (`apply_policy`, `quantize()`, `PolicyHandle.remove()`)
call `model_changed(root)` once a change is committed; upper layers that keep
something in step with the model (the Hugging Face integration keeps
`model.config.quantization_config` and `model.hf_quantizer` current) register
a callback with `add_listener`. This is how the lower layers reach them
without importing them.

A listener never makes a committed change fail: an exception it raises
becomes a warning naming it.

A minor change (`minor=True`: modules registered under a policied model
joined its application or left it) only adds or takes off modules under an
application in force; a listener may defer its work for it.

>>> seen = []
>>> def listener(model, minor):
...     seen.append((model, minor))
>>> add_listener(listener)
>>> model_changed("a model")
>>> model_changed("a grown model", minor=True)
>>> remove_listener(listener)
>>> model_changed("another")
>>> seen
[('a model', False), ('a grown model', True)]
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

Listener = Callable[[Any, bool], None]

_listeners: list[Listener] = []


def add_listener(callback: Listener) -> None:
    """Calls `callback(root, minor)` after every committed change (once per callback)."""
    if not callable(callback):
        raise TypeError(f"add_listener() expects a callable. Received: {callback!r}")
    if callback not in _listeners:
        _listeners.append(callback)


def remove_listener(callback: Listener) -> None:
    """Stops calling `callback`; a no-op if it was not added."""
    if callback in _listeners:
        _listeners.remove(callback)


def model_changed(module: Any, minor: bool = False) -> None:
    """Tells every listener that `module` (the root of a change) changed."""
    for callback in tuple(_listeners):
        try:
            callback(module, minor)
        except Exception as e:
            name = getattr(callback, "__qualname__", repr(callback))
            warnings.warn(
                f"dtype_policies: the listener {name} failed after a change to "
                f"{type(module).__name__}: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=3,
            )


_write_listeners: list[Callable[[Any], None]] = []


def add_write_listener(callback: Callable[[Any], None]) -> None:
    """Calls `callback(root)` whenever `weights_written(root)` is told of
    writes to a model's weights that torch's version counters do not see."""
    if not callable(callback):
        raise TypeError(f"add_write_listener() expects a callable. Received: {callback!r}")
    if callback not in _write_listeners:
        _write_listeners.append(callback)


def weights_written(module: Any) -> None:
    """Tells the write listeners that `module`'s weights may have changed
    behind torch's version counters (`clear_cast_caches`)."""
    for callback in tuple(_write_listeners):
        callback(module)


_step_skipped_listeners: list[Callable[[Any], None]] = []


def add_step_skipped_listener(callback: Callable[[Any], None]) -> None:
    """Calls `callback(optimizer)` whenever a loss scaler skips a step of the
    torch `optimizer` it wraps (`step_skipped`): state a backward pass wrote
    for that step is undone."""
    if not callable(callback):
        raise TypeError(f"add_step_skipped_listener() expects a callable. Received: {callback!r}")
    if callback not in _step_skipped_listeners:
        _step_skipped_listeners.append(callback)


def step_skipped(optimizer: Any) -> None:
    """Tells the listeners that a loss scaler skipped a step of `optimizer`."""
    for callback in tuple(_step_skipped_listeners):
        callback(optimizer)


class _BackwardOwner(threading.local):
    def __init__(self) -> None:
        self.optimizer: Any = None  # a weak reference, while a scaled loss back-propagates


_backward_owner = _BackwardOwner()


def scaled_loss_backward(loss: Any, optimizer: Any) -> None:
    """Marks the backward passes of the scaled `loss` as `optimizer`'s (the
    torch optimizer a loss scaler wraps), so that state a frozen module
    records in them belongs to that optimizer's step (`backward_owner`).
    The mark is set when the pass reaches `loss` and cleared when it ends
    (a reentrant checkpoint's nested pass inside it sees it too); it is per
    thread (a CPU backward pass runs in the thread that started it)."""
    if not (getattr(loss, "requires_grad", False) and hasattr(loss, "register_hook")):
        return
    owner = weakref.ref(optimizer)

    def clear() -> None:
        _backward_owner.optimizer = None

    def enter(grad: Any) -> Any:
        _backward_owner.optimizer = owner
        try:
            torch.autograd.Variable._execution_engine.queue_callback(clear)
        except (RuntimeError, AttributeError):  # pragma: no cover - outside a pass
            clear()
        return grad

    loss.register_hook(enter)


def backward_owner() -> Any:
    """The optimizer whose scaled loss the running backward pass of this
    thread started from (see `scaled_loss_backward`), else None."""
    owner = _backward_owner.optimizer
    return None if owner is None else owner()


def clear_backward_owner() -> None:
    """Clears this thread's mark: a pass that raised never cleared it (torch
    drops the callbacks queued in it); its recorders clear it once they run
    outside any backward pass."""
    _backward_owner.optimizer = None
