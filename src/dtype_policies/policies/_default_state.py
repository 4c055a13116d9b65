"""Where the default dtype policy is kept: one process-wide value and a
per-thread/per-task override. Only storage: `dtype_policies.default_policy`
parses and sets; policy classes read it to fill in omitted names."""

from __future__ import annotations

import contextvars
from typing import Any

process_default: Any = None  # a DTypePolicy, or None for float32
scoped_default: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "dtype_policies_scoped_default", default=None
)


def current() -> Any:
    """The default policy in force, or `None` (meaning float32)."""
    scoped = scoped_default.get()
    return scoped if scoped is not None else process_default
