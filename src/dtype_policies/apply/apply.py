"""`apply_policy`: dtype policies for any existing `torch.nn.Module` tree."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dtype_policies._paths import named_module_paths
from dtype_policies.apply import policy_module
from dtype_policies.layers.layer import Layer
from dtype_policies.policies import DTypePolicy
from dtype_policies.policy_map import DTypePolicyMap
from dtype_policies.serialization import get as get_policy

_FLOAT32 = DTypePolicy("float32")

DEFAULT_FLOAT32_MODULES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)
"""Normalization layers kept in float32 by default. Any module whose class name
ends with "Norm" (Hugging Face's `LlamaRMSNorm`, `T5LayerNorm`, ...) counts too."""

# Norm kernels that accept half inputs with float32 weights on CPU and compute
# their statistics in float32 (so the upcast pass can be skipped).
_HALF_INPUT_NORMS = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)

_GATHER_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)

Float32Rule = type[torch.nn.Module] | str | Callable[[str, torch.nn.Module], bool]


def _is_float32_module(path: str, module: torch.nn.Module, rules: Iterable[Float32Rule]) -> bool:
    for rule in rules:
        if isinstance(rule, type):
            if isinstance(module, rule):
                return True
        elif isinstance(rule, str):
            if type(module).__name__.endswith(rule):
                return True
        elif rule(path, module):
            return True
    return False


@dataclass
class PolicyHandle:
    """What `apply_policy` returns: the per-module policies, and `remove()`.

    Attributes:
        policies: `{path: policy}` for every module the policy was applied to.
        float32_paths: Paths kept in float32 as normalization islands.
    """

    module: torch.nn.Module = field(repr=False)
    policies: dict[str, DTypePolicy] = field(default_factory=dict)
    float32_paths: list[str] = field(default_factory=list)
    _installed: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _layers: list[tuple[Layer, Any, str | None]] = field(default_factory=list, repr=False)
    _token: object = field(default_factory=object, repr=False)
    removed: bool = False

    def remove(self) -> None:
        """Restores every module exactly as it was before `apply_policy`."""
        if self.removed:
            return
        for module in self._installed:
            if module.__dict__.get("_dp_token") is self._token:
                policy_module.uninstall(module)
        for layer, policy, path in self._layers:
            layer._dtype_policy = policy
            layer._path = path
            layer._refresh_policy_state()
        if self.module.__dict__.get("_dp_handle") is self:
            del self.module.__dict__["_dp_handle"]
        self.removed = True

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def apply_policy(
    module: torch.nn.Module,
    policy: Any,
    *,
    float32_modules: Iterable[Float32Rule] | None = None,
    cast_buffers: bool = True,
    weight_cache: bool = False,
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
    outputs handed back in the caller's dtype); a map entry that matches one
    explicitly overrides this. Embedding tables are read in their own dtype
    and the looked-up rows are cast. `torch.compile` traces the installed
    machinery without graph breaks.

    Args:
        module: The model.
        policy: A policy, a policy name, a torch dtype, or a `DTypePolicyMap`.
        float32_modules: What runs in float32 unless a map entry says
            otherwise: module classes, class-name suffixes, or callables
            `(path, module) -> bool`. Defaults to `DEFAULT_FLOAT32_MODULES`
            plus any class whose name ends with `"Norm"`. Pass `()` for none.
        cast_buffers: Whether floating buffers are read in the compute dtype
            too (never for float32 islands).
        weight_cache: Keep a compute-dtype copy of every weight between calls,
            refreshed whenever the parameter changes (an optimizer step,
            `load_state_dict`, any in-place edit). Repeated inference calls
            then cast nothing; the cost is the copies' memory (half the
            float32 weights' bytes for bfloat16). Without it only small
            weights (up to 65,536 elements) are kept, and a second copy of the
            model's weights never persists.

    Returns:
        A `PolicyHandle`; `handle.remove()` restores the model exactly.
        Applying a policy again replaces the previous application.

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
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"apply_policy() expects a torch.nn.Module. Received: {type(module).__name__}"
        )
    try:
        policy = get_policy(policy)
    except (TypeError, ValueError) as e:
        raise type(e)(f"apply_policy(): invalid policy {policy!r}: {e}") from None
    rules = (
        (*DEFAULT_FLOAT32_MODULES, "Norm") if float32_modules is None else tuple(float32_modules)
    )
    for rule in rules:
        if not (isinstance(rule, (type, str)) or callable(rule)):
            raise TypeError(
                "float32_modules entries must be module classes, class-name suffixes or "
                f"callables (path, module) -> bool. Received: {rule!r}"
            )
    root_path = (module.path or module.name) if isinstance(module, Layer) else ""

    # Resolve everything first, so that an error (an ambiguous map key, ...)
    # leaves the model untouched.
    plan = []
    for path, submodule in named_module_paths(module, root_path):
        if isinstance(policy, DTypePolicyMap):
            explicit = policy.matching_key(path) is not None
            resolved = policy[path]
        else:
            explicit, resolved = False, policy
        island = not explicit and _is_float32_module(path, submodule, rules)
        plan.append((path, submodule, _FLOAT32 if island else resolved, island))

    previous = module.__dict__.get("_dp_handle")
    if previous is not None:
        previous.remove()
    handle = PolicyHandle(module)
    for path, submodule, resolved, island in plan:
        handle.policies[path] = resolved
        if island:
            handle.float32_paths.append(path)
        if isinstance(submodule, Layer):
            handle._layers.append((submodule, submodule._dtype_policy, submodule._path))
            submodule._path = path or submodule.name
            submodule._dtype_policy = resolved
            submodule._refresh_policy_state()
            continue
        if policy_module.is_policy_module(submodule):  # from an earlier application
            policy_module.uninstall(submodule)
        policy_module.install(
            submodule,
            resolved,
            token=handle._token,
            island=island,
            half_passthrough=island and isinstance(submodule, _HALF_INPUT_NORMS),
            gather_only=isinstance(submodule, _GATHER_MODULES),
            cast_buffers=cast_buffers,
            keep_casts=weight_cache,
        )
        handle._installed.append(submodule)
    _quantize_by_policy(handle)
    module.__dict__["_dp_handle"] = handle
    return handle


def _quantize_by_policy(handle: PolicyHandle) -> None:
    """Quantizes the modules whose policy is quantized and that support its mode
    (the others compute with the policy's float source)."""
    from dtype_policies.quantization import torch_modules
    from dtype_policies.quantization.layer_support import QuantizableLayer
    from dtype_policies.quantization.linear import default_config

    for layer, _, _ in handle._layers:
        if isinstance(layer, QuantizableLayer):
            layer._quantize_from_policy()
    for submodule in handle._installed:
        policy = submodule.__dict__["_dp_policy"]
        mode = policy.quantization_mode
        if mode is None or mode not in torch_modules.supported_modes(submodule):
            continue
        if torch_modules.is_quantized(submodule):
            continue
        torch_modules.quantize_module(
            submodule,
            mode,
            default_config(mode, policy),
            getattr(policy, "amax_history_length", 1024),
        )
