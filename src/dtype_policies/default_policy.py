"""The default dtype policy: one process-wide value, and a scoped override.

`set_dtype_policy` sets the process-wide default (float32 until set).
`policy_scope` overrides it inside a `with` block for the current thread or
asyncio task only, so concurrent code never sees another scope's policy.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from dtype_policies.policies import DTypePolicy

_global_policy: DTypePolicy | None = None
_scoped_policy: contextvars.ContextVar[DTypePolicy | None] = contextvars.ContextVar(
    "dtype_policies_scoped_policy", default=None
)


def _to_policy(policy: Any) -> DTypePolicy:
    from dtype_policies.serialization import get

    if isinstance(policy, DTypePolicy):
        return policy
    if isinstance(policy, (str, torch.dtype)):
        return get(policy)
    raise ValueError(
        "Invalid `policy` argument. Expected the string name of a policy (such as "
        "'mixed_float16') or a `DTypePolicy` instance. "
        f"Received: policy={policy!r} (of type {type(policy)})"
    )


def set_dtype_policy(policy: DTypePolicy | str | torch.dtype) -> None:
    """Sets the process-wide default dtype policy.

    Layers and policies created afterwards use it when given no `dtype`;
    existing layers keep theirs. Inside a `policy_scope` block the scope's
    policy still wins.

    >>> import dtype_policies
    >>> dtype_policies.set_dtype_policy("mixed_bfloat16")
    >>> dtype_policies.dtype_policy()
    <DTypePolicy "mixed_bfloat16">
    >>> dtype_policies.set_dtype_policy("float32")
    """
    global _global_policy
    _global_policy = _to_policy(policy)


def dtype_policy() -> DTypePolicy:
    """Returns the default dtype policy in force: the innermost `policy_scope`,
    else the process-wide one (`float32` until `set_dtype_policy` is called).

    >>> import dtype_policies
    >>> dtype_policies.dtype_policy()
    <DTypePolicy "float32">
    """
    scoped = _scoped_policy.get()
    if scoped is not None:
        return scoped
    global _global_policy
    if _global_policy is None:
        _global_policy = DTypePolicy("float32")
    return _global_policy


@contextlib.contextmanager
def policy_scope(policy: DTypePolicy | str | torch.dtype) -> Iterator[DTypePolicy]:
    """Overrides the default policy inside a `with` block.

    The override holds for the current thread or asyncio task only, nests, and
    is undone on exit, also when the block raises.

    >>> import dtype_policies
    >>> with dtype_policies.policy_scope("mixed_bfloat16") as policy:
    ...     dtype_policies.dtype_policy().name
    'mixed_bfloat16'
    >>> dtype_policies.dtype_policy().name
    'float32'
    """
    resolved = _to_policy(policy)
    token = _scoped_policy.set(resolved)
    try:
        yield resolved
    finally:
        _scoped_policy.reset(token)
