"""`apply_policy`: dtype policies for any existing `torch.nn.Module` tree."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from dtype_policies._core import policy_module
from dtype_policies._core.compose import original_class
from dtype_policies._core.listeners import model_changed
from dtype_policies._core.module_rules import ModuleRule, matches_any, module_rules
from dtype_policies._core.module_state import (
    Token,
    drop_state_if_empty,
    ensure_state,
    pop_application,
    push_application,
    state_of,
)
from dtype_policies._core.sharded import refuse_replicated, refuse_sharded
from dtype_policies._core.state import compute_dtype_of
from dtype_policies._dtypes import is_float_dtype
from dtype_policies._modes import mode_record
from dtype_policies._paths import join, named_module_paths, root_path_of
from dtype_policies.layers.layer import Layer, LayerApplication
from dtype_policies.policies import DTypePolicy, DTypePolicyMap
from dtype_policies.policies import get as get_policy
from dtype_policies.policies.quantized import QuantizedDTypePolicy
from dtype_policies.quantization import attach, experts
from dtype_policies.quantization.adapters import adapter_modules, watch_merges
from dtype_policies.quantization.kernels import attention
from dtype_policies.quantization.kinds import kind_of, owns_matrix
from dtype_policies.quantization.report import (
    ADAPTER_DETAIL,
    ROUTER_DETAIL,
    shared_float_detail,
    shared_layout_detail,
)

_FLOAT32 = DTypePolicy("float32")

DEFAULT_FLOAT32_MODULES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)
"""Normalization layers kept in float32 by default. Any module whose class name
ends with "Norm" (Hugging Face's `LlamaRMSNorm`, `T5LayerNorm`, ...) and whose
submodules hold no parameters counts too (`named_like_a_norm`)."""


def named_like_a_norm(path: str, module: torch.nn.Module) -> bool:
    """A normalization layer by its class name (`LlamaRMSNorm`): the name ends
    with "Norm" and no submodule holds parameters, so that a block named after
    the norms it places (Wav2Vec2's `Wav2Vec2EncoderLayerStableLayerNorm`, an
    encoder layer of attention and MLPs) takes the policy it is given.

    >>> import torch
    >>> class T5LayerNorm(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.ones(4))
    >>> class EncoderLayerStableLayerNorm(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attention = torch.nn.Linear(4, 4)
    ...         self.layer_norm = torch.nn.LayerNorm(4)
    >>> named_like_a_norm("", T5LayerNorm()), named_like_a_norm("", EncoderLayerStableLayerNorm())
    (True, False)
    """
    if not original_class(module).__name__.endswith("Norm"):
        return False
    return not any(  # torch's parametrizations of its own weights are no submodules of it
        next(child.parameters(), None) is not None
        for name, child in module.named_children()
        if name != "parametrizations"
    )


_NORM_RULES: tuple[Any, ...] = (*DEFAULT_FLOAT32_MODULES, named_like_a_norm)

_LOSSES = torch.nn.modules.loss._Loss

DEFAULT_FLOAT32_RULES: tuple[Any, ...] = (*_NORM_RULES, _LOSSES)
"""`apply_policy`'s default `float32_modules`: those classes, `named_like_a_norm`,
and torch's loss modules held by a model (a loss computes in float32 and
returns a float32 value, as Keras's losses do; what the model's own call was
given, targets included, was cast at that call, as Keras casts a call's
floating arguments)."""

# Norm kernels that accept half inputs with float32 weights on CPU and compute
# their statistics in float32 (so the upcast pass can be skipped).
_HALF_INPUT_NORMS = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)

_GATHER_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)

Float32Rule = ModuleRule


def _is_norm(module: torch.nn.Module) -> bool:
    return matches_any("", module, _NORM_RULES)


@dataclass(frozen=True)
class Planning:
    """What an application was planned from, for the modules registered
    under its model later (`apply.joining`)."""

    policy: DTypePolicy
    rules: tuple
    cast_buffers: bool
    weight_cache: bool


_live_handles: weakref.WeakValueDictionary[object, PolicyHandle] = weakref.WeakValueDictionary()
"""The applications by token, while something holds their handle (the
module a handle is in force on does)."""


def _module_at(root: torch.nn.Module, root_path: str, path: str) -> torch.nn.Module | None:
    """The module at `path` (as `named_module_paths` names it) under `root`."""
    if path == root_path:
        return root
    if root_path:
        if not path.startswith(f"{root_path}/"):
            return None
        path = path[len(root_path) + 1 :]
    module: torch.nn.Module | None = root
    for name in path.split("/"):
        module = None if module is None else module._modules.get(name)
    return module


def live_handle(token: object) -> PolicyHandle | None:
    """The application of `token`, if it is still in force."""
    handle = _live_handles.get(token)
    return None if handle is None or handle.removed else handle


@dataclass
class PolicyHandle:
    """What `apply_policy` returns: the per-module policies, and `remove()`.

    Attributes:
        policies: `{path: policy}` for every module the policy was applied to.
        float32_paths: Paths kept in float32 as normalization islands.
        quantized_paths: Paths this application quantized.
        unquantized: `{path: why}` for the modules holding a weight matrix
            whose quantized policy left it in floating point (they compute
            with the policy's float source): a weight its parent reads
            directly, a class of no quantizable kind, a router, ...

    >>> import torch
    >>> from dtype_policies import apply_policy
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> handle = apply_policy(model, "mixed_bfloat16")
    >>> handle.policies["0"], handle.float32_paths
    (<DTypePolicy "mixed_bfloat16">, ['1'])
    >>> handle.remove()
    >>> model(torch.ones(1, 4)).dtype
    torch.float32
    """

    module: torch.nn.Module = field(repr=False)
    policies: dict[str, DTypePolicy] = field(default_factory=dict)
    float32_paths: list[str] = field(default_factory=list)
    quantized_paths: list[str] = field(default_factory=list)
    unquantized: dict[str, str] = field(default_factory=dict)
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _quantized: list[tuple[str, torch.nn.Module]] = field(default_factory=list, repr=False)
    _expansions: list[experts.ExpertsExpansion] = field(default_factory=list, repr=False)
    _hooks: list[Any] = field(default_factory=list, repr=False)
    _token: object = field(default_factory=object, repr=False)
    # how modules registered under the model later are planned (`joining`):
    # the policy (a map is read at their paths) and apply_policy's options
    _planning: Planning | None = field(default=None, repr=False)
    _paths: dict[int, str] = field(default_factory=dict, repr=False)  # path_of's last walk
    removed: bool = False

    def __post_init__(self) -> None:
        _live_handles[self._token] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copied or unpickled model's application (its own token) is in
        # force on the copy: modules registered there later join it too
        self.__dict__.update(state)
        _live_handles[self._token] = self

    def _install(self, steps: list[Step]) -> None:
        """Puts the steps' policies in force as part of this application."""
        install_steps(self._token, steps)
        for step in steps:
            self.policies[step.path] = step.policy
            if step.island:
                self.float32_paths.append(step.path)
            self._modules.append(step.module)

    def path_of(self, module: torch.nn.Module) -> str | None:
        """`module`'s path in the model now, if it is in it (a path found
        before is checked by walking down it, else the model is walked)."""
        root_path = root_path_of(self.module)
        known = self._paths.get(id(module))
        if known is not None and _module_at(self.module, root_path, known) is module:
            return known
        self._paths = {}
        for path, submodule in named_module_paths(self.module, root_path):
            self._paths.setdefault(id(submodule), path)
        return self._paths.get(id(module))

    def _leave(
        self, modules: list[torch.nn.Module], path: str, replaced: torch.nn.Module | None
    ) -> None:
        """Takes `modules` (replaced out of the model at `path`) out of this
        application, and the records of `replaced`'s tree (at `path`) off
        its records."""
        for module in modules:
            pop_application(module, self._token)
        if modules:
            gone = {id(module) for module in modules}
            self._modules = [module for module in self._modules if id(module) not in gone]
        if replaced is None:
            return
        doomed = {subpath for subpath, _ in named_module_paths(replaced, path)}
        for subpath in doomed:
            self.policies.pop(subpath, None)
            self.unquantized.pop(subpath or "(root)", None)
        self.float32_paths = [entry for entry in self.float32_paths if entry not in doomed]
        gone_quantized = {id(m) for m in modules}
        self._quantized = [(p, m) for p, m in self._quantized if id(m) not in gone_quantized]
        left = {p or "(root)" for p, _ in self._quantized}
        self.quantized_paths = [p for p in self.quantized_paths if p in left]

    def _record_under(self, module: torch.nn.Module, path: str) -> None:
        """Records the modules of `module`'s tree (at `path`) that compute by
        this application, where their records are missing (moved within the
        model)."""
        for subpath, submodule in named_module_paths(module, path):
            state = state_of(submodule)
            if subpath in self.policies or state is None:
                continue
            for token, entry in state.applications:
                if token is self._token:
                    self.policies[subpath] = entry.policy
                    if getattr(entry, "island", False):
                        self.float32_paths.append(subpath)

    def remove(self) -> None:
        """Undoes this application: every module computes as before it.

        Float policies and float8 are undone exactly (float8 kept the float
        weight; mixture-of-experts modules it expanded into one linear per
        expert get their 3-D weights back, as the linears' weights are now).
        Modules this application quantized to int8 or int4 stay quantized,
        since their float weights were replaced; a warning names them.
        """
        if self.removed:
            return
        refuse_sharded(self.module, "PolicyHandle.remove()")
        self._remove(stacklevel=3)
        model_changed(self.module)

    def _remove(self, stacklevel: int = 2, keep_quantized: bool = False) -> None:
        kept = []
        for path, module in [] if keep_quantized else self._quantized:
            if attach.quantization_of(module) is not None and (
                attach.quantization_of(module).scheme.keeps_float_weight
            ):
                attach.detach_float8(module)
                if isinstance(module, Layer):
                    module.quantization_config = None
            else:
                kept.append(path or "(root)")
        # and wherever the application was passed on since (the linears of a
        # mixture-of-experts module expanded under it: quantization.experts)
        for module in {id(m): m for m in (*self._modules, *self.module.modules())}.values():
            pop_application(module, self._token)
        # mixture-of-experts modules this application expanded, back to their
        # 3-D weights once none of their linears stays quantized
        for expansion in self._expansions:
            if expansion.detachable():
                expansion.detach()
        for hook in self._hooks:
            hook.remove()
        state = state_of(self.module)
        if state is not None and state.handle is self:
            state.handle = None
            drop_state_if_empty(self.module)
        self.removed = True
        if kept:
            warnings.warn(
                f"PolicyHandle.remove(): {len(kept)} module(s) quantized by this application "
                f"stay quantized (their float weights were replaced): {kept[:5]}"
                f"{' ...' if len(kept) > 5 else ''}. Reload them from a float checkpoint "
                "to undo the quantization.",
                UserWarning,
                stacklevel=stacklevel,
            )

    def _hand_over(self, successor: PolicyHandle, steps: list[Step]) -> None:
        """Passes to `successor` the modules this application quantized that
        `successor`'s steps quantize in the same mode and settings (with the
        mixture-of-experts expansions they belong to): the successor planned
        nothing for them, being quantized already, and this application's
        removal would undo float8 (which keeps its float weight) and warn
        that int8 and int4 stay quantized."""
        wanted = {
            id(step.module): step for step in steps if step.policy.quantization_mode is not None
        }
        kept: list[tuple[str, torch.nn.Module]] = []
        for path, module in self._quantized:
            step = wanted.get(id(module))
            quantized = attach.quantization_of(module)
            if (
                step is None
                or quantized is None
                or (_quantized_conflict(step.path, module, step.policy) is not None)
            ):
                kept.append((path, module))
                continue
            successor._quantized.append((step.path, module))
            successor.quantized_paths.append(step.path or "(root)")
        passed = {id(module) for _, module in successor._quantized}
        self._quantized = kept
        for expansion in list(self._expansions):
            if any(id(linear) in passed for linear in expansion.all_linears()):
                self._expansions.remove(expansion)
                if expansion not in successor._expansions:
                    successor._expansions.append(expansion)

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def applications_on(module: torch.nn.Module) -> frozenset[object]:
    """The tokens of the applications (`apply_policy`, a load) in force on
    `module` and its submodules, wherever they were made; not the permanent
    entries (a layer's own policy, `quantize()`'s own application)."""
    return frozenset(
        token
        for m in module.modules()
        if (state := state_of(m)) is not None
        for token, _ in state.applications
        if not isinstance(token, Token)
    )


def lift_applications(module: torch.nn.Module) -> None:
    """Takes every application off `module` and its submodules (those made on
    them entirely, hooks included), leaving what they quantized quantized,
    float8 too: a load replacing them planned with it."""
    for m in module.modules():
        handle = getattr(state_of(m), "handle", None)
        if handle is not None and not handle.removed:
            handle._remove(keep_quantized=True)
    tokens = applications_on(module)  # made on a module outside `module`
    for m in module.modules():
        for token in tokens:
            pop_application(m, token)


def entry_without(
    module: torch.nn.Module, tokens: frozenset[object]
) -> LayerApplication | policy_module.ModuleOptions | None:
    """The application entry `module` computes by once the applications
    `tokens` are lifted (a layer's own at least; `None` for a torch module
    left without one)."""
    state = state_of(module)
    entries = [] if state is None else [e for t, e in state.applications if t not in tokens]
    return entries[-1] if entries else None


def policy_without(module: torch.nn.Module, tokens: frozenset[object]) -> DTypePolicy | None:
    """The policy `module` computes by once the applications `tokens` are
    lifted (a map resolved at the layer's path); `None` for a torch module
    left without one."""
    entry = entry_without(module, tokens)
    if isinstance(entry, LayerApplication):
        policy = entry.policy
        if isinstance(policy, DTypePolicyMap):
            return policy[entry.path] if entry.path is not None else policy.default_policy
        return policy
    return None if entry is None else entry.policy


@dataclass
class Step:
    """One module's part of an application: its policy and, for torch modules,
    the options its call core gets (`None` for this library's layers)."""

    path: str
    module: torch.nn.Module
    policy: DTypePolicy
    island: bool = False
    options: policy_module.ModuleOptions | None = None
    explicit: bool = False  # its policy is a map entry's, not the map's default


def apply_policy(
    module: torch.nn.Module,
    policy: Any,
    *,
    float32_modules: Iterable[Float32Rule] | None = None,
    cast_buffers: bool = True,
    weight_cache: bool = True,
) -> PolicyHandle:
    """Makes every submodule of `module` compute by a dtype policy.

    Each submodule resolves its own policy: `policy` itself, or, for a
    `DTypePolicyMap`, the entry for the submodule's path (`/`-joined module
    names from `module`, which itself has the path `""`; dotted torch names
    work as regex keys since `.` matches `/`). During a submodule's forward,
    floating inputs are cast to its compute dtype, and its floating parameters
    and buffers are read in the compute dtype, while the parameters themselves
    stay what they are (float32 master weights under `mixed_bfloat16`): the
    same `Parameter` objects, so `state_dict()`, optimizers and checkpoints
    are untouched, and gradients arrive in the parameters' dtype.

    Normalization layers run in float32 by default (statistics in float32,
    outputs handed back in the caller's dtype); whatever their policy, their
    own parameters and running statistics are never cast (they keep updating
    in float32). Embedding tables are read in their own dtype and the
    looked-up rows are cast. Quantized policies (`"int8_from_mixed_bfloat16"`,
    ...) quantize the modules that support their mode; the others compute
    with the policy's float source. `torch.compile` traces all of it without
    graph breaks.

    Args:
        module: The model.
        policy: A policy, a policy name, a torch dtype, or a `DTypePolicyMap`.
        float32_modules: What runs in float32 unless a map entry says
            otherwise: module classes, class-name suffixes, or callables
            `(path, module) -> bool`. Defaults to `DEFAULT_FLOAT32_MODULES`
            plus any class whose name ends with `"Norm"` and whose submodules
            hold no parameters (`named_like_a_norm`). Pass `()` for none.
        cast_buffers: Whether floating buffers are read in the compute dtype
            too (never for float32 islands and normalization layers, nor
            non-persistent buffers: constants of a module's own code, such
            as rotary frequencies, read as stored).
        weight_cache: Keep the compute-dtype copy of a weight between calls
            when that copy carries no autograd graph (inference, frozen
            weights), until the weight changes. It costs the copies' memory
            (half the float32 weights' bytes for bfloat16) and saves a cast of
            every weight in every inference call; `False` casts in every call.

    Returns:
        A `PolicyHandle`; `handle.remove()` undoes the application. Applying
        a policy again to the same module replaces the previous application;
        applications to a submodule and to its parent nest (the latest wins
        where they overlap, and removing it brings back the one below).

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
    ...                             torch.nn.Linear(16, 4))
    >>> handle = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> model(torch.randn(2, 8)).dtype, model[0].weight.dtype
    (torch.bfloat16, torch.float32)
    >>> handle.float32_paths
    ['1']
    >>> handle.remove()
    >>> model(torch.randn(2, 8)).dtype
    torch.float32
    """
    steps, plans, unquantized, planning = _plan_application(
        module, policy, float32_modules, cast_buffers, weight_cache, stacklevel=3
    )
    handle = commit_application(module, steps, plans, planning=planning)
    handle.unquantized = unquantized
    return handle


@contextlib.contextmanager
def tentative_application(
    module: torch.nn.Module,
    policy: Any,
    *,
    float32_modules: Iterable[Float32Rule] | None = None,
) -> Iterator[PolicyHandle]:
    """`apply_policy(module, policy)` in force inside the block, kept only if
    the block completes.

    The new application goes over the one in force on `module` (from an
    earlier `apply_policy` or `saving.load`). When the block raises, the new
    one is removed and the earlier one is in force again, its handle still
    valid: the model is as it was. When it completes, the earlier one is
    removed, as `apply_policy` would have replaced it. (A policy that
    quantizes int8 or int4 weights cannot be undone: its callers refuse them.)

    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> earlier = apply_policy(model, "mixed_bfloat16")
    >>> try:
    ...     with tentative_application(model, "float16"):
    ...         raise RuntimeError("a later step failed")
    ... except RuntimeError:
    ...     pass
    >>> model.dtype_policy.name, earlier.removed
    ('mixed_bfloat16', False)
    """
    steps, plans, unquantized, planning = _plan_application(
        module, policy, float32_modules, True, True, stacklevel=5
    )
    previous = getattr(state_of(module), "handle", None)
    if previous is not None and previous.removed:
        previous = None
    handle = commit_application(module, steps, plans, replace=False, planning=planning)
    handle.unquantized = unquantized
    try:
        yield handle
    except BaseException:
        handle._remove()
        if previous is not None:
            ensure_state(module).handle = previous
        model_changed(module)
        raise
    if previous is not None:
        previous._hand_over(handle, steps)
        previous._remove(stacklevel=5)
        model_changed(module)


def _refuse_uninitialized(module: torch.nn.Module) -> None:
    """`ValueError` naming the lazy modules (`nn.LazyLinear`, ...) whose
    parameters are not made yet: their first forward replaces their class
    (torch's `cls_to_become`), and with it the policy's."""
    lazy = [
        f"'{name or '(model)'}' ({type(submodule).__name__})"
        for name, submodule in module.named_modules()
        if _has_lazy_tensors(submodule)
    ]
    if lazy:
        raise ValueError(
            f"apply_policy(): {', '.join(lazy[:3])}{' and more' if len(lazy) > 3 else ''} "
            "not initialized yet: a lazy module becomes its final class (nn.Linear, ...) in "
            "its first forward, which would drop the policy. Run one forward pass first, then "
            "apply the policy. Nothing was changed."
        )


def _has_lazy_tensors(module: torch.nn.Module) -> bool:
    tensors = (*module.parameters(recurse=False), *module.buffers(recurse=False))
    return any(is_lazy(tensor) for tensor in tensors)


def _plan_application(
    module: torch.nn.Module,
    policy: Any,
    float32_modules: Iterable[Float32Rule] | None,
    cast_buffers: bool,
    weight_cache: bool,
    stacklevel: int,
) -> tuple[list[Step], list[attach.Plan], dict[str, str], Planning]:
    """`apply_policy`'s steps, quantization plans, `{path: why}` of the
    modules its quantized policy leaves float, and what it was planned
    from; changes nothing."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"apply_policy() expects a torch.nn.Module. Received: {type(module).__name__}"
        )
    refuse_sharded(module, "apply_policy()")
    _refuse_uninitialized(module)
    try:
        policy = get_policy(policy)
    except (TypeError, ValueError) as e:
        raise type(e)(f"apply_policy(): invalid policy {policy!r}: {e}") from None
    rules = (
        DEFAULT_FLOAT32_RULES
        if float32_modules is None
        else module_rules(float32_modules, "apply_policy(): float32_modules")
    )
    for name, flag in (("cast_buffers", cast_buffers), ("weight_cache", weight_cache)):
        if not isinstance(flag, bool):
            raise TypeError(f"apply_policy(): {name} must be True or False. Received: {flag!r}")

    # Plan everything first, so that an error leaves the model untouched.
    steps, used_keys = _plan_policies(module, policy, rules, cast_buffers, weight_cache)
    plans, expert_steps, declined = _plan_quantization(steps)
    if plans:
        refuse_replicated(module, "apply_policy() with a quantized policy")
    steps += expert_steps
    declined = [(step, why) for step, why in declined if owns_matrix(step.module)]
    explicit = [step for step, _ in declined if step.explicit]
    if explicit:
        named = ", ".join(f"'{step.path}' ({type(step.module).__name__})" for step in explicit[:5])
        warnings.warn(
            f"apply_policy(): {len(explicit)} module(s) given a quantized policy by a "
            f"DTypePolicyMap key cannot be quantized in its mode and compute with the "
            f"policy's float source instead: {named}.",
            UserWarning,
            stacklevel=stacklevel,
        )
    if policy.is_map:
        unused = [key for key in policy if key not in used_keys]
        shared = _second_paths(module) if unused else {}
        for key in unused:
            later_paths = [
                (path, first) for path, first in shared.items() if _decides(policy, path) == key
            ]
            if later_paths:
                path, first = later_paths[0]
                message = (
                    f"apply_policy(): the DTypePolicyMap key {key!r} matches only {path!r}, "
                    f"another path of the module at {first!r}: a module reachable by several "
                    f"paths takes the policy of its first path (write the key for {first!r})."
                )
            else:
                message = (
                    f"apply_policy(): the DTypePolicyMap key {key!r} matches no module path "
                    f"(paths look like {_example_paths(steps)}; they use '/' between names)."
                )
            warnings.warn(message, UserWarning, stacklevel=stacklevel)
    unquantized = {step.path or "(root)": why for step, why in declined}
    return steps, plans, unquantized, Planning(policy, rules, cast_buffers, weight_cache)


def _decides(policy_map: Any, path: str) -> str | None:
    """The key of `policy_map` deciding `path`'s policy (`None`: none, or several)."""
    try:
        return policy_map.matching_key(path)
    except ValueError:
        return None


def _second_paths(module: torch.nn.Module) -> dict[str, str]:
    """Other paths of modules reachable by several routes, each with the
    module's first path (the one it is planned under): each registration of
    a module under a parent's first path, so one path per registration, not
    one per route (which can be exponentially many)."""
    root = root_path_of(module)
    first = {
        id(sub): join(root, dotted.replace(".", "/")) for dotted, sub in module.named_modules()
    }
    later = {}
    for parent in module.modules():
        for name, child in parent._modules.items():
            if child is None:
                continue
            path = join(first[id(parent)], name)
            if path != first[id(child)]:
                later[path] = first[id(child)]
    return later


def steps_under(
    module: torch.nn.Module,
    policy: DTypePolicy,
    path: str,
    *,
    rules: tuple = DEFAULT_FLOAT32_RULES,
    cast_buffers: bool = True,
    weight_cache: bool = True,
    enclosing: torch.dtype | None = None,
) -> list[Step]:
    """The steps `apply_policy(module, policy)` would plan (float32 islands
    included) for `module` at `path` (`/`-joined, its path in the model the
    steps are committed on: a `DTypePolicyMap` is read at the full paths),
    its outputs going back in `enclosing` where given. A quantized policy
    gives its float source: nothing is quantized. Changes nothing.

    >>> import torch
    >>> head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> [(s.path, s.policy.name) for s in steps_under(head, DTypePolicy("mixed_bfloat16"), "head")]
    [('head', 'mixed_bfloat16'), ('head/0', 'mixed_bfloat16'), ('head/1', 'float32')]
    >>> [s.policy.name for s in steps_under(head, get_policy("int8_from_mixed_bfloat16"), "")]
    ['mixed_bfloat16', 'mixed_bfloat16', 'float32']
    """
    steps, _ = _plan_policies(
        module,
        policy,
        rules,
        cast_buffers,
        weight_cache,
        root_path=path,
        enclosing_root=enclosing,
        float_sources=True,
    )
    return steps


def commit_application(
    module: torch.nn.Module,
    steps: list[Step],
    plans: list[attach.Plan],
    *,
    replace: bool = True,
    planning: Planning | None = None,
) -> PolicyHandle:
    """Applies planned steps and quantizations to `module` as one application
    (replacing an earlier one on the same module; with `replace=False`, over
    it, which its caller removes), planned from `planning` where there is one
    (modules registered later are planned from it). Cannot fail."""
    previous = getattr(state_of(module), "handle", None)
    handle = PolicyHandle(module, _planning=planning)
    with attach.committing(plans):  # (raises before any change, when it does)
        if replace and previous is not None and not previous.removed:
            previous._hand_over(handle, steps)
            previous._remove(stacklevel=4)
        handle._install(steps)
        for plan in plans:
            attach.commit(plan)
            handle._quantized.append((plan.path, plan.module))
            if plan.expansion is not None and plan.expansion not in handle._expansions:
                handle._expansions.append(plan.expansion)
            handle.quantized_paths.append(plan.path or "(root)")
    # a transformers model's bfloat16 attention on this library's kernel where the CPU has it
    handle._hooks = attention.attend_on_kernel(module)
    watch_merges(module)  # peft's merges write through `.data`
    ensure_state(module).handle = handle
    model_changed(module)
    return handle


def install_steps(token: object, steps: list[Step]) -> None:
    """Puts the steps' policies in force on their modules as the application
    `token` (cannot fail)."""
    for step in steps:
        if step.options is None:
            # (`options` is None for this library's layers only)
            entry = LayerApplication(step.policy, step.path or cast(Layer, step.module).name)
            push_application(step.module, token, entry)
        else:
            policy_module.install(step.module, token, step.options)


def _plan_policies(
    module: torch.nn.Module,
    policy: DTypePolicy,
    rules: tuple,
    cast_buffers: bool,
    weight_cache: bool,
    *,
    root_path: str | None = None,
    enclosing_root: torch.dtype | None = None,
    float_sources: bool = False,
) -> tuple[list[Step], set[str]]:
    """The steps of `module`'s tree, its paths under `root_path` (by default
    the root's own: a named layer's), and the map keys used; the root's
    outputs go back in `enclosing_root` where given (the module it is part
    of computes in it); `float_sources`: a quantized policy gives its float
    source (the module is not quantized)."""
    steps, used_keys, conflicts = [], set(), []
    if root_path is None:
        root_path = root_path_of(module)
    computes: dict[str, torch.dtype | None] = {}  # each path's compute dtype
    weight_computations: list[str] = []  # the paths of parametrizations' lists
    for path, submodule in named_module_paths(module, root_path):
        explicit = False
        resolved = policy
        if policy.is_map:
            policy_map = cast(DTypePolicyMap, policy)
            try:
                key = policy_map.matching_key(path)
            except ValueError as e:
                raise ValueError(f"apply_policy(): {e}") from None
            explicit = key is not None
            if key is not None:
                used_keys.add(key)
            resolved = policy_map[path]
        if float_sources and isinstance(resolved, QuantizedDTypePolicy):
            resolved = resolved.source_policy
        if resolved.quantization_mode is None and not is_float_dtype(resolved.compute_dtype):
            raise ValueError(
                f"apply_policy(): the policy '{resolved.name}' for '{path or '(root)'}' "
                f"computes in {resolved.compute_dtype}, which is not a floating dtype. To "
                "quantize weights, use a quantized policy such as 'int8_from_mixed_bfloat16' "
                "or 'int4_from_mixed_bfloat16', or call dtype_policies.quantize()."
            )
        island = not explicit and matches_any(path, submodule, rules)
        conflict = _quantized_conflict(path, submodule, resolved, island)
        if conflict is not None:
            conflicts.append(conflict)
            continue
        resolved = _FLOAT32 if island else resolved
        computes_weight = issubclass(original_class(submodule), parametrize.ParametrizationList)
        if computes_weight:
            weight_computations.append(path)
        if not explicit and any(path == p or path.startswith(p + "/") for p in weight_computations):
            # A parametrization computes a weight: in the variable dtype, as
            # Keras computes variables (torch's bfloat16 `matrix_exp`, under
            # `orthogonal`, returns NaN); the module reads it in its own dtype.
            resolved = DTypePolicy(resolved.variable_dtype)
        computes[path] = compute_dtype_of(resolved)
        if path != root_path:
            enclosing = computes.get(path.rsplit("/", 1)[0] if "/" in path else "")
        else:  # what the code around the model computes in: the map's default
            around = policy.default_policy if isinstance(policy, DTypePolicyMap) else None
            enclosing = compute_dtype_of(around) if explicit and around is not None else None
            if enclosing_root is not None:
                enclosing = enclosing_root
        options = None
        if not isinstance(submodule, Layer):
            options = policy_module.ModuleOptions(
                policy=resolved,
                # a loss keeps its float32 value (an island hands outputs back)
                island=island and not issubclass(original_class(submodule), _LOSSES),
                half_inputs_ok=island and issubclass(original_class(submodule), _HALF_INPUT_NORMS),
                norm=_is_norm(submodule),
                gather=issubclass(original_class(submodule), _GATHER_MODULES),
                cast_buffers=cast_buffers,
                weight_cache=weight_cache,
                outputs=(
                    _read_as(computes[path], enclosing)
                    if computes_weight
                    else _handed_back(computes[path], enclosing)
                ),
            )
        steps.append(Step(path, submodule, resolved, island, options, explicit))
    if conflicts:
        others = [path for path, _ in conflicts[1:]]
        also = f" The same holds for {others}." if others else ""
        raise ValueError(
            f"apply_policy(): {conflicts[0][1]}.{also} Apply a float policy whose compute "
            "dtype the module's mode takes (a quantized module computes with it) or rebuild "
            "the model from a float checkpoint."
        )
    return steps, used_keys


def _handed_back(compute: torch.dtype | None, enclosing: torch.dtype | None) -> str | None:
    """The dtype a module's outputs go back in: the enclosing module's, where
    the module computes in a narrower one (`mixed_bfloat16` q/k/v projections
    of a float32 attention, whose q and k meet a float32 rotary table and v
    does not); `None` otherwise (a wider module, a float32 head in a bfloat16
    model, keeps its outputs as Keras does)."""
    if compute is None or enclosing is None or compute.itemsize >= enclosing.itemsize:
        return None
    return str(enclosing).removeprefix("torch.")


def _read_as(compute: torch.dtype | None, enclosing: torch.dtype | None) -> str | None:
    """The dtype a parametrization's weight goes back in: its module's compute
    dtype (a weight is read in the compute dtype, wider or narrower)."""
    if compute is None or enclosing is None or compute == enclosing:
        return None
    return str(enclosing).removeprefix("torch.")


def _quantized_conflict(
    path: str, module: torch.nn.Module, policy: DTypePolicy, island: bool = False
) -> tuple[str, str] | None:
    """`(path, why)` if `module` is quantized and cannot take `policy`: a
    quantized module takes float policies whose compute dtype its mode
    accepts (it computes with them; a float32 `island` computes in float32)
    or a quantized policy of its own mode and settings, nothing else."""
    quantized = attach.quantization_of(module)
    mode = policy.quantization_mode
    if quantized is None or (mode is None and island):
        return None
    if mode is None:
        try:
            mode_record(quantized.mode).check_compute_dtype(policy.compute_dtype)
        except ValueError as error:
            label = path or "(root)"
            return label, (
                f"the module at '{label}' is quantized in mode '{quantized.mode}', which "
                f"cannot compute in {policy.compute_dtype} (the policy '{policy.name}'; "
                f"{str(error).rstrip('.')})"
            )
        return None
    quantized_policy = cast(QuantizedDTypePolicy, policy)  # `mode` is not None
    if mode == quantized.mode and quantized_policy.quantization_config == quantized.config:
        return None
    label = path or "(root)"
    return label, (
        f"the module at '{label}' is quantized in mode '{quantized.mode}' "
        f"({quantized.config}); it cannot take the policy '{policy.name}' "
        f"(mode '{mode}', {quantized_policy.quantization_config})"
    )


def _plan_quantization(
    steps: list[Step],
) -> tuple[list[attach.Plan], list[Step], list[tuple[Step, str]]]:
    """The quantizations the steps' quantized policies ask for, the steps of
    the per-expert linears of mixture-of-experts modules expanded for them
    (`quantization.experts`: each linear takes its module's step), and the
    steps whose module cannot take its policy's mode (it computes with the
    policy's float source), each with why. Routers compute with their
    policy's float source, as `quantize()` keeps them."""
    plans, expert_steps, declined = [], [], []
    planned_weights: dict[int, attach.Plan] = {}  # id(weight) -> its first plan
    modules = {step.path: step.module for step in steps}
    routers = experts.expert_routers(step.module for step in steps)
    adapters = adapter_modules(step.module for step in steps)
    # every module checked (a NaN weight in the last one refused at once)
    # before any is planned (minutes of rounding for a large model)
    jobs: list[tuple[Step, list[_Checked], experts.ExpertsExpansion | None]] = []
    for step in steps:
        mode = step.policy.quantization_mode
        if mode is None:
            continue
        if id(step.module) in routers:
            declined.append((step, ROUTER_DETAIL))
            continue
        if id(step.module) in adapters:  # trained in floating point, as quantize() keeps them
            if owns_matrix(step.module):
                declined.append((step, ADAPTER_DETAIL))
            continue
        layout = experts.experts_layout(step.module)
        if layout is not None and "linear" in mode_record(mode).roles:
            expansion = experts.ExpertsExpansion(step.module, layout)
            # inside the module, in its compute dtype: its outputs alone go back
            inner = step.options and dataclasses.replace(step.options, outputs=None)
            linear_steps = [
                Step(path, linear, step.policy, step.island, inner)
                for path, linear in expansion.linears(under=step.path)
            ]
            jobs.append((step, [_check_one(s, modules) for s in linear_steps], expansion))
        else:
            jobs.append((step, [_check_one(step, modules)], None))
    for step, checked, expanded in jobs:
        if expanded is not None:
            linear_plans = [p for p, _ in (_plan_one(c, planned_weights) for c in checked) if p]
            experts.ExpertsExpansion.claim_all(linear_plans, [expanded])
            if linear_plans:
                plans += linear_plans
                expert_steps += [c.step for c in checked]
            continue
        module_plan, why = _plan_one(checked[0], planned_weights)
        if module_plan is not None:
            plans.append(module_plan)
        elif why is not None:
            declined.append((step, why))
    plans, shared_float = _stored_once(steps, plans)
    declined += shared_float
    return plans, expert_steps, declined


def _stored_once(
    steps: list[Step], plans: list[attach.Plan]
) -> tuple[list[attach.Plan], list[tuple[Step, str]]]:
    """A weight shared by modules (a tied embedding and LM head) is stored
    quantized in all of them, in one mode, or in none, as `quantize()`
    stores it: a module whose policy keeps it in floating point keeps the
    whole table, and another's quantized copy would only add to it (that
    module computes with its policy's float source instead; float8 keeps
    its float weight and adds no copy). Two modes for one weight raise."""
    step_of = {id(step.module): step for step in steps}
    # float8 keeps its float weight: like a float module, it keeps the table
    planned = {id(plan.module) for plan in plans if not plan.scheme.keeps_float_weight}
    kept_float: dict[int, str] = {}  # id(parameter) -> the path of a module keeping it float
    for step in steps:
        if id(step.module) in planned or attach.quantization_of(step.module) is not None:
            continue
        for parameter in step.module._parameters.values():
            if parameter is not None:
                kept_float.setdefault(id(parameter), step.path or "(root)")
    modes: dict[int, attach.Plan] = {}
    kept, declined = [], []
    unshareable = attach.unshareable_ties(plans)
    for plan in plans:
        weight = plan.module._parameters.get(plan.spec.weight)
        if weight is None or plan.scheme.keeps_float_weight:
            kept.append(plan)
            continue
        first = modes.setdefault(id(weight), plan)
        if first.config != plan.config:
            raise ValueError(
                f"apply_policy(): '{plan.path or '(root)'}' and '{first.path or '(root)'}' "
                f"share one weight, which cannot be stored in two modes ({plan.config} and "
                f"{first.config}): give both modules one quantized policy, or a float one "
                "to either."
            )
        holder = kept_float.get(id(weight))
        if id(plan) in unshareable:
            if id(plan.module) in step_of:
                detail = shared_layout_detail(unshareable[id(plan)])
                declined.append((step_of[id(plan.module)], detail))
        elif holder is None:
            kept.append(plan)
        elif id(plan.module) in step_of:
            declined.append((step_of[id(plan.module)], shared_float_detail(holder)))
    return kept, declined


@dataclass(frozen=True)
class _Checked:
    """One step's quantized policy, checked (`found`, with the config and the
    float source to plan with), or why its module computes with the policy's
    float source (`why`; `None` for a module quantized already)."""

    step: Step
    found: attach.Checked | None = None
    config: Any = None
    why: str | None = None


def _check_one(step: Step, modules: dict[str, torch.nn.Module]) -> _Checked:
    """`attach.check` of one step's quantized policy (its weight's values
    among the checks). Raises `ValueError` (its own type kept, such as
    `NonFiniteWeightError`) naming the module."""
    mode = step.policy.quantization_mode
    kind = kind_of(step.module)
    if mode is None or attach.quantization_of(step.module) is not None:
        return _Checked(step)
    if kind is None:
        return _Checked(step, why=f"{original_class(step.module).__name__}, not a quantizable kind")
    if not kind.supports(mode):
        return _Checked(step, why=f"{kind.role} weights take {', '.join(kind.modes) or 'no mode'}")
    policy = cast(QuantizedDTypePolicy, step.policy)  # `mode` is not None
    config = policy.quantization_config
    if isinstance(step.module, Layer):
        existing = getattr(step.module, "quantization_config", None)
        if existing is not None and existing.mode == mode:
            config = existing
    try:
        found = attach.check(
            step.module,
            config,
            path=step.path,
            type_check=False,
            kind=kind,
            source=policy.source_policy,
            modules=modules,
        )
    except NotImplementedError as e:
        return _Checked(step, why=str(e))  # computes with the policy's float source
    except ValueError as e:
        raise type(e)(f"apply_policy(): module '{step.path or '(root)'}': {e}") from None
    return _Checked(step, found, config)


def _plan_one(
    checked: _Checked, planned_weights: dict[int, attach.Plan]
) -> tuple[attach.Plan | None, str | None]:
    """The plan of one checked step, or `None` and why the module computes
    with the policy's float source (no kind, the mode unsupported, its weight
    read by its parent; no reason when quantized already)."""
    found, step = checked.found, checked.step
    if found is None:
        return None, checked.why
    try:
        module_plan = attach.plan(
            step.module,
            checked.config,
            path=step.path,
            type_check=False,
            kind=found.kind,
            source=found.source,
            # a table tied to a head: quantized once, its stored tensors shared
            tensors=attach.shared_tensors(step.module, found.spec, checked.config, planned_weights),
        )
    except NotImplementedError as e:
        return None, str(e)  # computes with the policy's float source
    except ValueError as e:  # its own type (NonFiniteWeightError) kept
        raise type(e)(f"apply_policy(): module '{step.path or '(root)'}': {e}") from None
    weight = step.module._parameters.get(module_plan.spec.weight)
    if weight is not None:
        planned_weights.setdefault(id(weight), module_plan)
    return module_plan, None


def _example_paths(steps: list[Step]) -> str:
    paths = [step.path for step in steps if step.path][:3]
    return ", ".join(repr(path) for path in paths) or "''"
