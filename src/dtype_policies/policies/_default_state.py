"""Where the default dtype policy is kept: one process-wide value and a
per-thread/per-task override. Only storage: `dtype_policies.default_policy`
parses and sets; policy classes read it to fill in omitted names."""

from __future__ import annotations

import contextvars
from typing import Any

process_default: Any = None  # a DTypePolicy, or None for float32


class _Scope:
    """One open scope: its policy, and whether it has exited (seen by every
    context holding it, also one the exit did not run in: a generator
    suspended inside a scope and closed from another thread or task)."""

    __slots__ = ("closed", "policy")

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.closed = False


# The scopes of this thread or asyncio task, innermost last. Each scope is
# removed on exit wherever it sits by then: a generator suspended inside a
# scope can finish inside a scope its caller opened later, which must stay
# in force.
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
    scope opened after it in force; in every context that holds it."""
    if isinstance(marker, _Scope):
        marker.closed = True
    scopes.set(tuple(scope for scope in scopes.get() if not scope.closed))
