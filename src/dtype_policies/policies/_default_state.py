"""Where the default dtype policy is kept: one process-wide value and a
per-thread/per-task override. Only storage: `dtype_policies.default_policy`
parses and sets; policy classes read it to fill in omitted names."""

from __future__ import annotations

import contextvars
from typing import Any

process_default: Any = None  # a DTypePolicy, or None for float32
# The open scopes of this thread or asyncio task, innermost last, each
# `(its own marker, its policy)`. Each scope removes its own entry on exit,
# wherever it sits by then: a generator suspended inside a scope can finish
# inside a scope its caller opened later, which must stay in force.
scopes: contextvars.ContextVar[tuple[tuple[object, Any], ...]] = contextvars.ContextVar(
    "dtype_policies_scopes", default=()
)


def current() -> Any:
    """The default policy in force, or `None` (meaning float32)."""
    open_scopes = scopes.get()
    return open_scopes[-1][1] if open_scopes else process_default


def enter_scope(policy: Any) -> object:
    """Opens a scope of `policy`; returns the marker `exit_scope` takes."""
    marker = object()
    scopes.set((*scopes.get(), (marker, policy)))
    return marker


def exit_scope(marker: object) -> None:
    """Closes the scope `enter_scope` returned `marker` for, leaving any
    scope opened after it in force."""
    scopes.set(tuple(scope for scope in scopes.get() if scope[0] is not marker))
