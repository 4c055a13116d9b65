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
A parametrization (`torch.nn.utils.parametrize`) registered later, on a
layer's own weight or a module's, computes its weight in the variable
dtype and hands it back in the compute dtype inside a call, as
`apply_policy` plans one registered before it.

Left as they are: the subtrees of the new module that carry a policy or
quantization of their own (a `Layer`, a policied or quantized module moved
from elsewhere or from the model itself, as peft's adapter wraps a
policied linear: the adapter's own modules join around it; a torch module
moved in from another policied model takes this model's policy below that
model's, in force once that model lets it go or its application is
removed), and what
torch writes into a container without
registering it (`Sequential.insert`, `ModuleList.insert`: apply the policy
again after them). `del model.x` runs no hook: the module keeps its policy
(`handle.remove()` still undoes it); `model.x = None` takes it off. A
planning error (a map key matching ambiguously) raises from the
registration with the new module unregistered; torch has by then dropped
a plain attribute of the same name.

Registering is cheap for large models: the model's path of a parent is
checked, not searched, where it is known, and a Hugging Face model's
`quantization_config` is described again when next read.

>>> import torch
>>> from dtype_policies import apply_policy
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
>>> handle = apply_policy(model, "mixed_bfloat16")
>>> model[1] = torch.nn.Linear(8, 3)  # a new head
>>> model(torch.randn(2, 8)).dtype, model[1].dtype_policy.name, handle.policies["1"].name
(torch.bfloat16, 'mixed_bfloat16', 'mixed_bfloat16')
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.utils.parametrize import ParametrizationList

from dtype_policies._core import policy_module
from dtype_policies._core.compose import original_class
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
from dtype_policies.layers.layer import LAYER_OWN, Layer, add_child_planner
from dtype_policies.quantization.adapters import merges_seen, watch_merges
from dtype_policies.quantization.modules import QUANTIZE_TOKEN

IN_LAYER = Token("IN_LAYER")
"""The token of the policy a torch module registered under a `Layer` takes
from the layer (the bottom of its stack: an `apply_policy` goes on top)."""


def _subtrees(module: torch.nn.Module, rooted_at: Any) -> set[int]:
    """The ids of the modules of `module`'s tree inside a subtree whose root
    `rooted_at(m)` accepts (the root included)."""
    found: set[int] = set()
    for submodule in module.modules():  # parents before their children
        if id(submodule) not in found and rooted_at(submodule):
            found.update(id(m) for m in submodule.modules())
    return found


def _carries_its_own(module: torch.nn.Module) -> bool:
    """A `Layer`, or a module policied (by an application in force) or
    quantized already."""
    state = state_of(module)
    if isinstance(module, Layer):
        return True
    if state is None:
        return False
    live = any(_owned(entry[0]) for entry in state.applications)
    return live or state.quantization is not None


def _owned(token: object) -> bool:
    """A named token (a layer's own policy, `quantize()`'s entry) or an
    application in force."""
    return isinstance(token, Token) or live_handle(token) is not None


def _orphans(module: torch.nn.Module) -> list[object]:
    """The applications on `module` that no application in force owns: a
    copy's (`copy.deepcopy` or pickle of a policied part of a model, as
    torch's `fuse_conv_bn_eval` makes), whose handle stayed with the model
    it was copied from. A copy joining a policied model leaves them, so that
    the model's `remove()` takes off everything it computes with."""
    state = state_of(module)
    if state is None:
        return []
    return [entry[0] for entry in state.applications if not _owned(entry[0])]


# One registration plans and commits at a time: two threads registering
# under one model would otherwise interleave their records.
_LOCK = threading.RLock()


def _joining(parent: torch.nn.Module, name: str, child: Any) -> None:
    """Torch's module-registration hook: plans, under each application in
    force on `parent`, `child`'s policies and the leaving of the module it
    replaces (`child` may be `None`); then commits them all (a planning
    error leaves the module registered before in place)."""
    if not (child is None or isinstance(child, torch.nn.Module)):
        return None
    state = state_of(parent)
    if state is None or not state.applications:
        return None
    with _LOCK:
        _join(parent, name, child, state)
    return None


def _join(parent: torch.nn.Module, name: str, child: torch.nn.Module | None, state: Any) -> None:
    replaced = parent._modules.get(name)
    # the subtrees of `child` that carry their own keep it
    carried = set() if child is None else _subtrees(child, _carries_its_own)
    joins = child is not None and id(child) not in carried
    planned: list[tuple[object, PolicyHandle | None, str, list[torch.nn.Module], list]] = []
    below: list[tuple[object, Any]] = []  # (token, step) under another model's application
    for token, entry in tuple(state.applications):  # the bottom one first: the top one wins
        if token is LAYER_OWN and isinstance(parent, Layer):
            leaving = _leaving(parent, parent, name, child, replaced)
            in_layer = [] if child is None else _in_layer_plan(parent, name, child)
            planned.append((IN_LAYER, None, name, leaving, in_layer))
            continue
        if token is IN_LAYER and child is not None:  # under a torch module of a layer
            steps = steps_under(child, entry.policy, name, enclosing=compute_dtype_of(entry.policy))
            leaving = _leaving(parent, parent, name, child, replaced)
            planned.append((IN_LAYER, None, name, leaving, _outside_layers(child, steps)))
            continue
        if isinstance(token, Token):
            continue  # quantize()'s own entry: not an application
        handle = live_handle(token)
        parent_path = None if handle is None else handle.path_of(parent)
        known = handle if parent_path is not None else None  # the parent's place is known
        path = f"{parent_path}/{name}" if parent_path else name
        leaving = [] if known is None else _leaving(known.module, parent, name, child, replaced)
        steps = [] if child is None or not joins else _steps(parent, child, path, entry, known)
        moved_in = set() if child is None or known is None else _moved_in(child, carried, token)
        if moved_in and child is not None:
            every = steps if joins else _steps(parent, child, path, entry, known)
            below.extend((token, step) for step in every if id(step.module) in moved_in)
        planned.append((token, known, path, leaving, _outside(steps, carried)))
    if replaced is not None:
        merges_seen(replaced)  # peft's merge_and_unload: merged, then replaced by its base
    if child is not None and planned:
        watch_merges(child)
        for module in child.modules():  # a copied quantized module or layer too
            for orphan in _orphans(module):
                pop_application(module, orphan)
    changed = []
    for token, known, path, leaving, steps in planned:
        if token is IN_LAYER:
            for module in leaving:
                pop_application(module, token)
            _commit_in_layer(steps)
            continue
        if known is None:
            for module in leaving:
                pop_application(module, token)
            install_steps(token, steps)
            handle = live_handle(token)
            if handle is not None:  # a module outside the model: remove() still undoes it
                handle._modules.extend(step.module for step in steps)
            continue
        known._leave(leaving, path, replaced)
        known._install(steps)
        if child is not None:
            known._record_under(child, path)  # modules moved within the model
        for below_token, step in below:  # (not in the records: another policy is in force)
            if below_token is token:  # under the application it carries from elsewhere
                policy_module.install(step.module, token, step.options, bottom=True)
                known._modules.append(step.module)
        if steps or leaving or replaced is not None:
            changed.append(known)
    # minor: torch runs this hook before it registers `child`, so the listeners
    # describe the model when next read (a Hugging Face manifest), not now
    for handle in {id(k): k for k in changed}.values():
        model_changed(handle.module, minor=True)


def _moved_in(child: torch.nn.Module, carried: set[int], token: object) -> set[int]:
    """The ids of the torch modules of `child`'s tree that carry another
    model's application and not `token`'s (moved in from a policied model):
    `token`'s policy goes below theirs, in force once that model lets them
    go or its application is removed. Quantized modules and this library's
    layers keep only their own."""
    found = set()
    for module in child.modules():
        state = state_of(module)
        if id(module) not in carried or isinstance(module, Layer) or state is None:
            continue
        tokens = [entry[0] for entry in state.applications]
        if state.quantization is not None or token in tokens:
            continue
        if any(not isinstance(other, Token) for other in tokens):
            found.add(id(module))
    return found


def _outside(steps: list, carried: set[int]) -> list:
    return [step for step in steps if id(step.module) not in carried]


def _steps(
    parent: torch.nn.Module,
    child: torch.nn.Module,
    path: str,
    entry: Any,
    known: PolicyHandle | None,
) -> list:
    """`child`'s steps at `path` under one application: by what the
    application was planned from where it and the parent's place in its
    model are known (`known`); else by the parent's policy (also under a
    parametrization, which computes its weight in the variable dtype, as
    the parent's policy already says)."""
    parent_policy = getattr(entry, "policy", None)
    if parent_policy is None:
        return []
    planning = None if known is None else known._planning
    if planning is None or issubclass(original_class(parent), ParametrizationList):
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
    """The steps of a torch module registered as `layer`'s attribute `name`,
    from the layer's own policy (not an application over it): a map read at
    `<layer path>/<name>`, norms in float32, outputs back in the layer's
    compute dtype; none when the layer does not autocast. A float32 layer's
    too: a narrower sublayer may feed the torch module a bfloat16 tensor."""
    state = state_of(layer)
    if state is None or state.applications[0][0] is not LAYER_OWN or not layer.autocast:
        return []
    own = state.applications[0][1]
    policy = own.policy
    path = own.path if own.path is not None else (layer._path or layer.name)
    resolved = policy[path] if policy.is_map else policy
    return steps_under(child, policy, f"{path}/{name}", enclosing=compute_dtype_of(resolved))


def _in_layer_plan(layer: Layer, name: str, child: torch.nn.Module) -> list:
    """`[(module, options or None)]`: the entry each module of `child`'s
    tree outside this library's layers takes from `layer` (`None`: none)."""
    return _outside_layers(child, _steps_in_layer(layer, name, child))


def _outside_layers(child: torch.nn.Module, planned: list) -> list:
    """`[(module, options or None)]` for the modules of `child`'s tree outside
    this library's layers, by the steps `planned` (`None`: no step)."""
    steps = {id(step.module): step for step in planned}
    inside = _subtrees(child, lambda module: isinstance(module, Layer))
    plan = []
    for module in child.modules():
        if id(module) not in inside:
            step = steps.get(id(module))
            plan.append((module, None if step is None else step.options))
    return plan


def _commit_in_layer(plan: list) -> None:
    """Puts each module's `IN_LAYER` entry as planned, where it was (at the
    bottom for a new one: an application or a quantization over it stays in
    force)."""
    for module, options in plan:
        state = state_of(module)
        index = None
        if state is not None:
            index = next((i for i, (t, _) in enumerate(state.applications) if t is IN_LAYER), None)
        if options is None:
            if index is not None:
                pop_application(module, IN_LAYER)
        elif state is None or index is None:
            policy_module.install(module, IN_LAYER, options, bottom=True)
            _above_permanent(module)
        else:
            state.applications[index] = (IN_LAYER, options)
            module._refresh_policy_state()


def _above_permanent(module: torch.nn.Module) -> None:
    """Moves a module's `IN_LAYER` entry (put at the bottom) above the
    permanent entries there (`quantize()`'s own): the layer's policy is what
    the quantized module computes with, as it was before being planned again."""
    applications = state_of(module).applications  # type: ignore[union-attr]
    entry = applications.pop(0)
    at = 0
    while at < len(applications) and applications[at][0] is QUANTIZE_TOKEN:
        at += 1
    applications.insert(at, entry)
    refresh: Any = module._refresh_policy_state
    refresh()


def _plan_layer_children(layer: Layer) -> None:
    """Plans again what `layer` gives its torch children (its policy, path
    or `autocast` changed)."""
    with _LOCK:
        for name, child in list(layer._modules.items()):
            if child is not None and not isinstance(child, Layer):
                _commit_in_layer(_in_layer_plan(layer, name, child))


def _leaving(
    root: torch.nn.Module,
    parent: torch.nn.Module,
    name: str,
    child: torch.nn.Module | None,
    replaced: torch.nn.Module | None,
) -> list[torch.nn.Module]:
    """The modules of the one `child` replaces that leave `root`'s tree with it."""
    if replaced is None or replaced is child:
        return []
    inside_child = set() if child is None else {id(m) for m in child.modules()}
    if all(id(m) in inside_child for m in replaced.modules()):
        return []  # wrapped by the new module (peft's adapters, a new head around the old)
    reachable = _reachable_after(root, parent, name, child)
    return [m for m in replaced.modules() if id(m) not in reachable]


def _reachable_after(
    root: torch.nn.Module, parent: torch.nn.Module, name: str, child: torch.nn.Module | None
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
add_child_planner(_plan_layer_children)
