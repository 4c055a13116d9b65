"""Modules registered under a policied model after `apply_policy` join the
applications in force on their parent.

Replacing a classification head for fine-tuning (`model.classifier =
nn.Linear(...)`), appending a block to a `ModuleList`, or transformers'
`resize_token_embeddings` registers a new module under a model whose modules
compute in bfloat16: without a policy, a float32 `nn.Linear` there fails on
the bfloat16 outputs around it. So a module registered under a module an
application planned (torch's module-registration hook, for every route:
attribute assignment, `add_module`, `ModuleList.append`, ...) gets the
policies that application would have given it at its path, as if applied
again: a `DTypePolicyMap` read at its path, normalization layers in float32,
its outputs handed back as the modules around it expect. A quantized
policy gives its float source: a new module is not quantized (quantize it
with `quantize()`). `handle.remove()` undoes it with the rest.

Left as they are: a module that carries a policy or quantization of its own
anywhere in its tree (a `Layer`, a policied or quantized module moved from
elsewhere, peft's adapter wrapping a policied linear), and torch's
parametrization containers, which keep their documented behaviour.

>>> import torch
>>> from dtype_policies import apply_policy
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
>>> handle = apply_policy(model, "mixed_bfloat16")
>>> model[1] = torch.nn.Linear(8, 3)  # a new head
>>> model(torch.randn(2, 8)).dtype, model[1].dtype_policy.name, handle.policies["1"].name
(torch.bfloat16, 'mixed_bfloat16', 'mixed_bfloat16')
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._core.listeners import model_changed
from dtype_policies._core.module_state import state_of
from dtype_policies._core.state import compute_dtype_of
from dtype_policies.apply.apply import DEFAULT_FLOAT32_RULES, live_handle, steps_under
from dtype_policies.layers.layer import Layer

_PARAMETRIZATIONS = "parametrizations"  # torch.nn.utils.parametrize's container


def _carries_its_own(module: torch.nn.Module) -> bool:
    """Whether a module of the tree has a policy or quantization already."""
    for submodule in module.modules():
        if isinstance(submodule, Layer):
            return True
        state = state_of(submodule)
        if state is not None and (state.applications or state.quantization is not None):
            return True
    return False


def _joining(parent: torch.nn.Module, name: str, child: Any) -> None:
    """Torch's module-registration hook: plans `child`'s policies under each
    application in force on `parent`, then puts them all in force (a
    planning error leaves the registration undone and the model as it was)."""
    if not isinstance(child, torch.nn.Module) or name == _PARAMETRIZATIONS:
        return None
    state = state_of(parent)
    if state is None or not state.applications or _carries_its_own(child):
        return None
    planned = []
    for token, _ in state.applications:  # the bottom one first: the top one wins
        handle = live_handle(token)
        parent_path = None if handle is None else handle._paths.get(id(parent))
        if handle is None or parent_path is None:
            continue
        path = f"{parent_path}/{name}" if parent_path else name
        around = handle.policies.get(parent_path)
        planning = handle._planning
        policy = planning.policy if planning is not None else around
        if policy is None:
            continue
        steps = steps_under(
            child,
            policy,
            path,
            rules=planning.rules if planning is not None else DEFAULT_FLOAT32_RULES,
            cast_buffers=planning.cast_buffers if planning is not None else True,
            weight_cache=planning.weight_cache if planning is not None else True,
            enclosing=compute_dtype_of(around) if around is not None else None,
        )
        planned.append((handle, steps))
    for handle, steps in planned:
        handle._install(steps)
    for handle, _ in planned:
        model_changed(handle.module)
    return None


torch.nn.modules.module.register_module_module_registration_hook(_joining)
