"""The variable-autocast scope (Keras's `AutocastScope`).

While a scope is active in a thread, a policied module's weights read inside
a call come back in the scope's dtype, each cast once per scope. A module
call opens a new scope (never shared between calls or threads), keeps the
enclosing one, or disables casting, by Keras's rules (`scope_for_call`).
A cast written in place during the call (a buffer's running statistics, a
weight constraint applied in a forward) reaches its tensor: before the
tensor is read again, and when the scope ends; a parameter takes only the
elements the write changed, so the rest keep their float32 precision.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from dtype_policies._compat import compiling
from dtype_policies._core.casting import cast_tensor, tracing
from dtype_policies._core.tensor_identity import view_key


class AutocastScope:
    """One call's variable-autocast context: the target dtype (`None`:
    casting disabled) and the casts made so far."""

    __slots__ = ("_casts", "_handed", "dtype")

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        # id(tensor) -> (tensor, its cast, `stamp(tensor)` when cast); the
        # tensor is held so that its id cannot be reused by another tensor
        # while the scope lives.
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        # id(tensor) -> (tensor, cast, `stamp(cast)`, whether it is a buffer):
        # the casts handed to code that may write them (see `settle`)
        self._handed: dict[int, tuple[torch.Tensor, torch.Tensor, tuple, bool]] | None = None

    def cast(self, value: torch.Tensor) -> torch.Tensor:
        """`value` in this scope's dtype, cast at most once per scope."""
        if tracing():  # the compiler deduplicates casts itself
            return cast_tensor(value, self.dtype)
        entry = self._casts.get(id(value))
        if self._handed and self.settle(value):
            entry = None  # a copy of it was written: `value` has the write now
        now = stamp(value)
        if (
            entry is None
            or entry[0] is not value
            # written earlier in this call (an update step inside a forward)
            or entry[2] != now
            # made under no_grad earlier in this call: a read with gradients needs a graph
            or (value.requires_grad and not entry[1].requires_grad and torch.is_grad_enabled())
        ):
            entry = self._casts[id(value)] = (value, cast_tensor(value, self.dtype), now)
        return entry[1]

    def cast_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """Like `cast`, and remembers the pair so that an in-place update of
        the cast copy during the call reaches `buffer` when the scope ends."""
        if tracing():
            return cast_tensor(buffer, self.dtype)
        entry = self._casts.get(id(buffer))
        if entry is not None and entry[0] is buffer:
            if entry[2] == stamp(buffer):
                return entry[1]
            self.settle(buffer)  # written directly: a write to its copy reaches it first
        # under inference_mode, a normal tensor, whose version counter tells a
        # write to it (an inference tensor has none: a running statistic's
        # update was lost)
        normal = torch.inference_mode(False) if torch.is_inference_mode_enabled() else None
        with normal or contextlib.nullcontext():
            cast = cast_tensor(buffer, self.dtype)
        self._casts[id(buffer)] = (buffer, cast, stamp(buffer))
        self.hand(buffer, cast, is_buffer=True)
        return cast

    def hand(self, tensor: torch.Tensor, cast: torch.Tensor, is_buffer: bool = False) -> None:
        """Remembers that `cast`, `tensor` in this scope's dtype, was handed
        to code that may write it in place (a read by attribute), so that a
        write reaches `tensor` (see `settle`)."""
        handed = self._handed
        if handed is None:
            handed = self._handed = {}
        else:
            known = handed.get(id(tensor))
            if known is not None and known[1] is cast:
                return
        # (never while tracing: its callers return before)
        if not cast.is_inference():  # else no version counter to tell
            handed[id(tensor)] = (tensor, cast, stamp(cast), is_buffer)

    def settle(self, tensor: torch.Tensor) -> bool:
        """Whether the copy of `tensor` this scope handed out was written since
        (or since it was last settled); the write then reaches `tensor`: a
        buffer takes the copy whole (running statistics), a parameter only
        the elements the write changed (the others keep their precision)."""
        handed = self._handed.get(id(tensor)) if self._handed else None
        if handed is None or handed[0] is not tensor:
            return False
        cast = handed[1]
        now = stamp(cast)
        if now == handed[2]:
            return False
        self._handed[id(tensor)] = (tensor, cast, now, handed[3])  # type: ignore[index]
        with torch.no_grad():
            if handed[3] or tensor.layout is not torch.strided:  # (sparse: no elementwise where)
                tensor.copy_(cast)
            else:
                changed = cast != cast_tensor(tensor, cast.dtype)
                tensor.copy_(torch.where(changed, cast.to(tensor.dtype), tensor))
        return True

    def write_back(self) -> None:
        """Writes into their tensors the copies that the call wrote."""
        for tensor, *_ in list(self._handed.values()):  # type: ignore[union-attr]
            self.settle(tensor)


stamp = view_key
"""What a write to a tensor changes (`tensor_identity.view_key`), read at
every cast of a call; `contents_key`'s storage reference (a weak reference
made per read) is left out of this per-call check."""


DISABLED = AutocastScope(None)
"""The scope of modules that opt out of weight casting (it never casts)."""


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # The active scope last. A stack, not one attribute holding the scope:
        # dynamo in torch 2.6 fails to guard such an attribute when it
        # recompiles a frame resumed inside a scope (after a graph break).
        self.scopes: list[AutocastScope] = []


_state = _ThreadState()


def current_scope() -> AutocastScope | None:
    """The autocast scope active in this thread, if any."""
    scopes = _state.scopes
    return scopes[-1] if scopes else None


def call_in_scope(
    call: Callable[..., Any], scope: AutocastScope | None, args: tuple, kwargs: dict
) -> Any:
    """`call(*args, **kwargs)` with `scope` active (`None`: as things are)."""
    if scope is None:
        return call(*args, **kwargs)
    scopes = _state.scopes
    scopes.append(scope)
    try:
        return call(*args, **kwargs)
    finally:
        scopes.pop()
        if scope._handed:
            scope.write_back()


def checkpoint_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for a function
    that reads a policied module's weights by attribute inside the module's
    forward (`checkpoint(self.inner, x, use_reentrant=False,
    context_fn=checkpoint_contexts)`): the recomputation in the backward pass
    runs outside the module's call, so it re-enters the autocast scopes of
    the forward (with casts of its own) and reads the weights as it did.
    A checkpointed module call (`checkpoint(self.block, x)`) needs nothing.

    >>> import torch, dtype_policies
    >>> from torch.utils.checkpoint import checkpoint
    >>> class Block(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.randn(8, 8))
    ...     def inner(self, x):
    ...         return torch.nn.functional.linear(x, self.weight)
    ...     def forward(self, x):
    ...         return checkpoint(self.inner, x, use_reentrant=False,
    ...                           context_fn=dtype_policies.checkpoint_contexts)
    >>> block = Block()
    >>> _ = dtype_policies.apply_policy(block, "mixed_bfloat16")
    >>> out = block(torch.randn(2, 8))
    >>> out.dtype
    torch.bfloat16
    >>> out.float().sum().backward()
    >>> block.weight.grad.dtype
    torch.float32
    """
    if compiling():
        # the traced region recomputes its own ops, casts included: torch's
        # own contexts (it takes no others), recomputing everything
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(_recompute_everything)
    dtypes = [scope.dtype for scope in _state.scopes]
    return contextlib.nullcontext(), _scopes_of(dtypes)


def _recompute_everything(context: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _scopes_of(dtypes: list[torch.dtype | None]) -> Iterator[None]:
    outer = _state.scopes
    _state.scopes = [AutocastScope(dtype) for dtype in dtypes]
    try:
        yield
    finally:
        _state.scopes = outer


def scope_for_call(
    compute: torch.dtype | None, autocast: bool, has_weights: bool
) -> AutocastScope | None:
    """The scope a module call enters (`None`: keep the current one).

    A module with no weights anywhere below it never needs a scope. At the top
    level, a module computing in a floating dtype opens its own. Inside
    another module's scope, one that opts out of autocasting or computes in a
    non-floating dtype disables casting; one with another compute dtype opens
    its own; otherwise the enclosing scope is kept (Keras's rules).
    """
    if not has_weights:
        return None
    current = current_scope()
    if current is None:
        return AutocastScope(compute) if compute is not None and autocast else None
    if not autocast or compute is None:
        return None if current.dtype is None else DISABLED
    if current.dtype != compute:
        return AutocastScope(compute)
    return None
