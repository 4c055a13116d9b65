"""Modules registered under a policied model after `apply_policy` join the
applications in force on their parent; modules replaced out of it leave.

Replacing a classification head for fine-tuning (`model.classifier =
nn.Linear(...)`), appending a block to a `ModuleList`, or transformers'
`resize_token_embeddings` registers a new module under a model whose modules
compute in bfloat16: without a policy, a float32 `nn.Linear` there fails on
the bfloat16 outputs around it. So a module registered under a module with
an application in force (torch's module-registration hook: attribute
assignment, `add_module`, `ModuleList.append`, item assignment, ...) gets
the policies that application would have given it at its path, as if
applied again: a `DTypePolicyMap` read at its path, normalization layers in
float32 (the `float32_modules` apply_policy was given), its outputs handed
back as the modules around it expect. A quantized policy gives its float
source: a new module is not quantized (quantize it with `quantize()`).
`handle.remove()` undoes it with the rest. Where the application is not
known (a model restored by `saving.load` or `from_pretrained`, whose map and
rules are not saved; a submodule kept after its model was dropped) the new
module takes its parent's policy, with the default float32 rules. The
module a registration replaces leaves the application (its policy is taken
off, unless it is still part of the model elsewhere).

A torch module registered under one of this library's layers (an
`nn.Linear` made in a custom `Layer`'s `__init__` or `build`) computes with
the layer's policy in the same way (a map read at `<layer path>/<name>`,
norms in float32, outputs back in the layer's compute dtype), under any
application over the layer; under a float32 layer it is left as it is.

Left as they are: a module that carries a policy or quantization of its own
anywhere in its tree (a `Layer`, a policied or quantized module moved from
elsewhere, peft's adapter wrapping a policied linear), torch's
parametrization containers, and what torch writes into a container without
registering it (`Sequential.insert`, `ModuleList.insert`: apply the policy
again after them).

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
from dtype_policies._core.module_state import Token, pop_application, state_of
from dtype_policies._core.state import compute_dtype_of
from dtype_policies.apply.apply import (
    DEFAULT_FLOAT32_RULES,
    Planning,
    PolicyHandle,
    install_steps,
    live_handle,
    steps_under,
)
from dtype_policies.layers.layer import LAYER_OWN, Layer

_PARAMETRIZATIONS = "parametrizations"  # torch.nn.utils.parametrize's container

IN_LAYER = Token("IN_LAYER")
"""The token of the policy a torch module registered under a `Layer` takes
from the layer (the bottom of its stack: an `apply_policy` goes on top)."""


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
    """Torch's module-registration hook: plans, under each application in
    force on `parent`, `child`'s policies and the leaving of the module it
    replaces; then commits them all (a planning error leaves the
    registration undone and the model as it was)."""
    if not isinstance(child, torch.nn.Module) or name == _PARAMETRIZATIONS:
        return None
    state = state_of(parent)
    if state is None or not state.applications:
        return None
    replaced = parent._modules.get(name)
    joins = not _carries_its_own(child)
    planned: list[tuple[object, PolicyHandle | None, str, list[torch.nn.Module], list]] = []
    for token, entry in state.applications:  # the bottom one first: the top one wins
        if token is LAYER_OWN and isinstance(parent, Layer):
            steps = _steps_in_layer(parent, name, child) if joins else []
            planned.append(
                (IN_LAYER, None, name, _leaving_layer(parent, name, child, replaced), steps)
            )
            continue
        if isinstance(token, Token):
            continue  # quantize()'s own entry: not an application
        handle = live_handle(token)
        parent_path = None if handle is None else handle.path_of(parent)
        known = handle if parent_path is not None else None  # the parent's place is known
        path = f"{parent_path}/{name}" if parent_path else name
        leaving = []
        if known is not None and replaced not in (None, child):
            reachable = _reachable_after(known.module, parent, name, child)
            leaving = [m for m in replaced.modules() if id(m) not in reachable]
        steps = _steps(child, path, entry, known) if joins else []
        planned.append((token, known, path, leaving, steps))
    for token, known, path, leaving, steps in planned:
        if known is None:
            for module in leaving:
                pop_application(module, token)
            install_steps(token, steps)
            continue
        if replaced is not None:
            known._leave(leaving, path)
        known._install(steps)
    for handle in {id(k): k for _, k, *_ in planned if k is not None}.values():
        model_changed(handle.module)
    return None


def _steps(child: torch.nn.Module, path: str, entry: Any, known: PolicyHandle | None) -> list:
    """`child`'s steps at `path` under one application: by what the
    application was planned from where it and the parent's place in its
    model are known (`known`); else by the parent's policy."""
    parent_policy = getattr(entry, "policy", None)
    if parent_policy is None:
        return []
    planning = None if known is None else known._planning
    if planning is None:
        planning = Planning(parent_policy, DEFAULT_FLOAT32_RULES, True, True)
    return steps_under(
        child,
        planning.policy,
        path,
        rules=planning.rules,
        cast_buffers=planning.cast_buffers,
        weight_cache=planning.weight_cache,
        enclosing=compute_dtype_of(parent_policy),
    )


def _steps_in_layer(layer: Layer, name: str, child: torch.nn.Module) -> list:
    """The steps of a torch module registered as `layer`'s attribute `name`:
    the layer's policy (a map read at `<layer path>/<name>`), norms in
    float32, outputs back in the layer's compute dtype; none under a plain
    float32 policy, which would change nothing."""
    policy = layer._dtype_policy
    resolved = layer._resolve_policy()
    if not policy.is_map and resolved.name == "float32":
        return []
    return steps_under(
        child,
        policy,
        f"{layer._path or layer.name}/{name}",
        enclosing=compute_dtype_of(resolved),
    )


def _leaving_layer(
    layer: Layer, name: str, child: torch.nn.Module, replaced: torch.nn.Module | None
) -> list[torch.nn.Module]:
    """The modules of the one `child` replaces that leave `layer` with it."""
    if replaced is None or replaced is child:
        return []
    reachable = _reachable_after(layer, layer, name, child)
    return [m for m in replaced.modules() if id(m) not in reachable]


def _reachable_after(
    root: torch.nn.Module, parent: torch.nn.Module, name: str, child: torch.nn.Module
) -> set[int]:
    """The ids of the modules reachable from `root` once `parent`'s `name`
    is `child`."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for key, submodule in module._modules.items():
            if module is parent and key == name:
                submodule = child
            if submodule is not None:
                stack.append(submodule)
    return seen


torch.nn.modules.module.register_module_module_registration_hook(_joining)
