"""`maybe_wrap`: wrap an optimizer for dynamic loss scaling when the policy
is `mixed_float16` (Keras's `auto_scale_loss`)."""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies.layers import Layer
from dtype_policies.optimizers.loss_scale_optimizer import LossScaleOptimizer
from dtype_policies.policies import (
    DTypePolicy,
    DTypePolicyMap,
    QuantizedDTypePolicy,
    default_policy,
    get,
)


def _policy_of(model_or_policy: Any) -> DTypePolicy:
    while True:  # wrappers that only replicate or compile the model
        if isinstance(
            model_or_policy, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        ):
            model_or_policy = model_or_policy.module
        elif isinstance(model_or_policy, torch.nn.Module) and isinstance(
            getattr(model_or_policy, "_orig_mod", None), torch.nn.Module
        ):
            model_or_policy = model_or_policy._orig_mod  # torch.compile's OptimizedModule
        else:
            break
    if isinstance(model_or_policy, torch.nn.Module):
        policy = getattr(model_or_policy, "dtype_policy", None)
        if not isinstance(policy, DTypePolicy):
            return default_policy()
        if isinstance(policy, DTypePolicyMap):
            path = model_or_policy.path if isinstance(model_or_policy, Layer) else None
            return policy[path] if path is not None else policy.default_policy
        return policy
    if isinstance(model_or_policy, DTypePolicyMap):
        return model_or_policy.default_policy
    if model_or_policy is None or isinstance(model_or_policy, (DTypePolicy, str, torch.dtype)):
        return get(model_or_policy)
    raise TypeError(
        "maybe_wrap() expects a torch.nn.Module, a DTypePolicy, a policy name or None "
        f"(the default policy). Received: {model_or_policy!r} "
        f"(of type {type(model_or_policy).__name__})"
    )


def maybe_wrap(optimizer: torch.optim.Optimizer, model_or_policy: Any) -> torch.optim.Optimizer:
    """Wraps `optimizer` in a `LossScaleOptimizer` if the policy is
    `mixed_float16`, else returns it unchanged (Keras's `auto_scale_loss`).

    The policy is `model_or_policy` itself (a `DTypePolicy` or a name; `None`
    means the default policy), or a module's own policy: a
    `dtype_policies.layers.Layer`'s `dtype_policy`, or the `dtype_policy` that
    `apply_policy` gives the root module. A module with no policy of its own
    (a plain `torch.nn.Sequential` of layers, say) is judged by the default
    policy `dtype_policies.dtype_policy()`; pass the policy explicitly then.
    A `DTypePolicyMap` counts by its entry for the layer (else its default).

    As in Keras only `"mixed_float16"` wraps: bfloat16 has float32's
    exponent range and needs no scaling, and `"float16"` (float16 parameters)
    is not wrapped either. A quantized policy counts by the policy it computes
    with (`"float8_from_mixed_float16"` wraps: its float32 weights train
    through float16 activations; in Keras the model keeps `"mixed_float16"`
    when its layers are quantized). A
    `DistributedDataParallel`, `DataParallel` or `torch.compile` wrapper
    counts by the module it wraps. An optimizer that already is a `LossScaleOptimizer` is
    returned as is.

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.optimizers import LossScaleOptimizer, maybe_wrap
    >>> model = torch.nn.Linear(4, 4)
    >>> handle = dtype_policies.apply_policy(model, "mixed_float16")
    >>> optimizer = maybe_wrap(torch.optim.AdamW(model.parameters()), model)
    >>> type(optimizer).__name__
    'LossScaleOptimizer'
    >>> maybe_wrap(optimizer, model) is optimizer
    True
    >>> type(maybe_wrap(torch.optim.AdamW(model.parameters()), "mixed_bfloat16")).__name__
    'AdamW'
    """
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "maybe_wrap() expects a torch.optim.Optimizer. "
            f"Received: {optimizer!r} (of type {type(optimizer).__name__})"
        )
    policy = _policy_of(model_or_policy)
    if isinstance(policy, QuantizedDTypePolicy):
        policy = policy.source_policy
    if policy.name == "mixed_float16":
        return LossScaleOptimizer(optimizer)
    return optimizer
