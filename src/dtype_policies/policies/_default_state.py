"""Where the default dtype policy is kept: one process-wide value and a
per-thread/per-task override. Only storage: `dtype_policies.default_policy`
parses and sets; policy classes read it to fill in omitted names."""

from __future__ import annotations

import contextvars
from typing import Any

process_default: Any = None  # a DTypePolicy, or None for float32


class _Scope:
    """One open scope: its policy, and whether it was exited outside the
    context it was entered in (a generator suspended inside a scope and
    closed from another thread or task), which only this flag can reach."""

    __slots__ = ("closed", "policy")

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.closed = False


# The scopes of this thread or asyncio task, innermost last. Each scope is
# removed on exit wherever it sits by then: a generator suspended inside a
# scope can finish inside a scope its caller opened later, which must stay
# in force. A context copied while a scope is open (a task created inside
# it) keeps the scope after the block that opened it exits, as context
# variables do.
scopes: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar(
    "dtype_policies_scopes", default=()
)


def current() -> Any:
    """The default policy in force, or `None` (meaning float32)."""
    for scope in reversed(scopes.get()):
        if not scope.closed:
            return scope.policy
    return process_default


def enter_scope(policy: Any) -> object:
    """Opens a scope of `policy`; returns the marker `exit_scope` takes."""
    scope = _Scope(policy)
    scopes.set((*scopes.get(), scope))
    return scope


def exit_scope(marker: object) -> None:
    """Closes the scope `enter_scope` returned `marker` for, leaving any
    scope opened after it in force: in this context, or, when the exit runs
    in another one (where the scope was never entered), wherever it is held."""
    open_scopes = scopes.get()
    if any(scope is marker for scope in open_scopes):
        scopes.set(tuple(scope for scope in open_scopes if scope is not marker))
    elif isinstance(marker, _Scope):
        marker.closed = True
