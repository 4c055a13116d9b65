"""The default dtype policy: one process-wide value, and a scoped override.

`set_dtype_policy` sets the process-wide default (float32 until set).
`policy_scope` overrides it inside a `with` block for the current thread or
asyncio task only, so concurrent code never sees another scope's policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dtype_policies.policies import DTypePolicy, _default_state, default_policy, get
from dtype_policies.policies.serialization import is_keras_policy


def _to_policy(policy: object) -> DTypePolicy:
    if isinstance(policy, DTypePolicy):
        return policy
    if isinstance(policy, (str, torch.dtype)) or is_keras_policy(policy):
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
    _default_state.process_default = _to_policy(policy)


def dtype_policy() -> DTypePolicy:
    """Returns the default dtype policy in force: the innermost `policy_scope`,
    else the process-wide one (`float32` until `set_dtype_policy` is called).

    >>> import dtype_policies
    >>> dtype_policies.dtype_policy()
    <DTypePolicy "float32">
    """
    return default_policy()


@contextlib.contextmanager
def policy_scope(policy: DTypePolicy | str | torch.dtype) -> Iterator[DTypePolicy]:
    """Overrides the default policy inside a `with` block.

    The override holds for the current thread or asyncio task only, nests,
    and is undone on exit, also when the block raises, and also when scopes
    exit out of order (a generator suspended inside a scope that finishes
    inside one its caller opened later: the caller's stays in force). A task
    created inside the block keeps the override for its whole run, as
    context variables are copied; a block whose exit runs in another thread
    or task than its entry (a generator closed there) is undone where it
    was entered too. A generator that yields inside the block leaves the
    override in force for its consumer until it resumes (context variables
    and generators, as `decimal.localcontext`): do not yield inside it.

    >>> import dtype_policies
    >>> with dtype_policies.policy_scope("mixed_bfloat16") as policy:
    ...     dtype_policies.dtype_policy().name
    'mixed_bfloat16'
    >>> dtype_policies.dtype_policy().name
    'float32'
    """
    resolved = _to_policy(policy)
    marker = _default_state.enter_scope(resolved)
    try:
        yield resolved
    finally:
        _default_state.exit_scope(marker)
