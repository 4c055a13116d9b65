"""What `apply_policy` installs on each module: a subclass of the module's own
class that casts inputs and weights by the module's policy.

The subclass keeps the class name, so `isinstance` checks, `repr` and
`state_dict()` are unchanged; only `type(module) is cls` checks see it.
Installing and removing it swaps `module.__class__` and touches no parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies._casting import (
    AutocastScope,
    LinearCastCache,
    call_in_scope,
    cast_floating,
    cast_inputs,
    cast_weight,
    current_scope,
    first_tensor,
    scope_for_call,
    warn_if_cpu_float16,
)
from dtype_policies.policies import DTypePolicy

# The per-module state `install` writes into `module.__dict__`.
STATE_KEYS = (
    "_dp_policy",
    "_dp_token",
    "_dp_compute",
    "_dp_input_cast",
    "_dp_output_cast",
    "_dp_island",
    "_dp_half_passthrough",
    "_dp_is_mixed",
    "_dp_autocast",
    "_dp_own_scope",
    "_dp_cast_names",
    "_dp_casts",
    "_dp_keep_casts",
    "_dp_linear_cache",
    "_dp_no_scope",
)


class ComposedModule:
    """Base of the classes this library puts in front of a module's own class
    (`PolicyModule`, the quantized-module mixins). Pickles as the original
    class plus the mixins, since the composed class itself is not importable."""

    _dp_original_class: type[torch.nn.Module]
    _dp_quantized_mixin: type | None
    _dp_with_policy: bool

    def __reduce_ex__(self, protocol: int) -> Any:
        cls = type(self)
        state = self.__dict__.copy()
        for key in ("_dp_casts", "_dp_quantized_casts"):  # casts made in grad mode
            if key in state:  # are graph nodes, not copyable state
                state[key] = {}
        state.pop("_dp_linear_cache", None)
        return (
            _new_module,
            (cls._dp_original_class, cls._dp_quantized_mixin, cls._dp_with_policy),
            state,
        )


class PolicyModule(ComposedModule):
    """Mixin placed in front of a module's class by `apply_policy`."""

    # Leaf modules whose forward casts their own weights need no autocast scope.
    _dp_casts_own_weights = False

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The policy `apply_policy` gave this module."""
        return self.__dict__["_dp_policy"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        cast_to = d["_dp_input_cast"]
        restore_to = None
        if d["_dp_island"]:
            first = first_tensor((args, kwargs), floating=True)
            if first is not None and first.dtype != cast_to:
                if (
                    d["_dp_half_passthrough"]
                    and first.dtype in (torch.bfloat16, torch.float16)
                    and (first.device.type == "cpu")
                ):
                    # torch's mixed-dtype norm kernel computes float32 statistics
                    # from half inputs and returns half outputs: no extra passes.
                    cast_to = None
                else:
                    restore_to = first.dtype
        if cast_to is not None:
            args, kwargs = cast_inputs(args, kwargs, cast_to)
            if cast_to is torch.float16:
                first = first_tensor((args, kwargs), floating=True)
                if first is not None:
                    warn_if_cpu_float16(first.device)
        scope = (
            None
            if self._dp_casts_own_weights or d["_dp_no_scope"]
            else scope_for_call(
                d["_dp_is_mixed"], d["_dp_autocast"], d["_dp_compute"], d["_dp_own_scope"]
            )
        )
        outputs = call_in_scope(super().__call__, scope, args, kwargs)
        if restore_to is not None:
            return cast_floating(outputs, restore_to)
        output_cast = d["_dp_output_cast"]
        if output_cast is not None:
            return cast_floating(outputs, output_cast)
        return outputs

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        names = d.get("_dp_cast_names")
        if names is not None and name in names:
            value = d["_parameters"].get(name)
            if value is None:
                value = d["_buffers"].get(name)
            if value is not None:
                scope = current_scope()
                if scope is not None and scope.dtype is not None and value.dtype != scope.dtype:
                    return cast_weight(d["_dp_casts"], name, value, scope, d["_dp_keep_casts"])
                return value
        return super().__getattr__(name)


class PolicyLinear(PolicyModule):
    """`PolicyModule` for an exact `nn.Linear`: its forward reads the weights in
    the compute dtype directly (a leaf needs no autocast scope), which keeps
    the call cost of small layers low."""

    _dp_casts_own_weights = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        parameters = d["_parameters"]
        weight, bias = parameters["weight"], parameters["bias"]
        compute = d["_dp_compute"]
        if compute is not None and (
            weight.dtype != compute or (bias is not None and bias.dtype != compute)
        ):
            cache = d.get("_dp_linear_cache")
            if cache is None:
                cache = d["_dp_linear_cache"] = LinearCastCache()
            weight, bias = cache.get(weight, bias, compute, d["_dp_keep_casts"])
        return F.linear(input, weight, bias)


_FAST_LINEARS = (torch.nn.Linear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)

_composed_classes: dict[tuple, type] = {}


def module_class(
    original: type[torch.nn.Module], quantized_mixin: type | None = None, policy: bool = False
) -> type[torch.nn.Module]:
    """`original` with a quantized-module mixin and/or `PolicyModule` in front
    (cached; `original` itself when neither is asked for)."""
    if quantized_mixin is None and not policy:
        return original
    key = (original, quantized_mixin, policy)
    cls = _composed_classes.get(key)
    if cls is None:
        policy_mixin = (
            PolicyLinear if original in _FAST_LINEARS and quantized_mixin is None else PolicyModule
        )
        bases = (
            *((policy_mixin,) if policy else ()),
            *((quantized_mixin,) if quantized_mixin is not None else (ComposedModule,)),
            original,
        )
        cls = type(
            original.__name__,
            bases,
            {
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "_dp_original_class": original,
                "_dp_quantized_mixin": quantized_mixin,
                "_dp_with_policy": policy,
            },
        )
        _composed_classes[key] = cls
    return cls


def _new_module(original: type, quantized_mixin: type | None, policy: bool) -> torch.nn.Module:
    return object.__new__(module_class(original, quantized_mixin, policy))


def is_policy_module(module: torch.nn.Module) -> bool:
    return isinstance(module, PolicyModule)


def class_parts(module: torch.nn.Module) -> tuple[type, type | None]:
    """`(original class, quantized mixin or None)` of a module."""
    cls = type(module)
    if issubclass(cls, ComposedModule):
        return cls._dp_original_class, cls._dp_quantized_mixin
    return cls, None


def install(
    module: torch.nn.Module,
    policy: DTypePolicy,
    *,
    token: object,
    island: bool,
    half_passthrough: bool,
    gather_only: bool,
    cast_buffers: bool,
    keep_casts: bool = False,
) -> None:
    """Makes `module` compute by `policy` (see `apply_policy` for the rules).

    `island`: compute in float32 and hand outputs back in the caller's dtype.
    `keep_casts`: keep the compute-dtype copy of every weight between calls
    (refreshed when the weight changes), not only of small ones.
    `gather_only`: the weights are looked up, not multiplied (embeddings), so
    the module's own forward reads them in their own dtype and its output is
    cast instead; other modules reading them (tied weights) still get casts.
    """
    compute_name = policy.compute_dtype
    compute = policy.torch_compute_dtype if compute_name.startswith(("float", "bfloat")) else None
    cast_names = set()
    if compute is not None:
        cast_names.update(
            name
            for name, p in module._parameters.items()
            if p is not None and p.is_floating_point()
        )
        if cast_buffers and not island:
            cast_names.update(
                name
                for name, b in module._buffers.items()
                if b is not None and b.is_floating_point()
            )
    tensors = {**module._buffers, **module._parameters}
    mixed = (
        compute is not None
        and not gather_only
        and (
            compute_name != policy.variable_dtype
            or any(tensors[name].dtype != compute for name in cast_names)
        )
    )
    d = module.__dict__
    d["_dp_policy"] = policy
    d["_dp_token"] = token
    d["_dp_compute"] = compute
    d["_dp_input_cast"] = compute
    d["_dp_output_cast"] = compute if gather_only else None
    d["_dp_island"] = island
    d["_dp_half_passthrough"] = half_passthrough
    d["_dp_is_mixed"] = mixed
    d["_dp_autocast"] = not gather_only
    d["_dp_own_scope"] = AutocastScope(compute) if compute is not None else None
    d["_dp_cast_names"] = frozenset(cast_names)
    d["_dp_casts"] = {}
    d["_dp_keep_casts"] = keep_casts
    # A module with no weights anywhere below it (an activation, dropout, ...)
    # has nothing to autocast: its calls skip the scope.
    d["_dp_no_scope"] = next(module.parameters(), None) is None and (
        next(module.buffers(), None) is None
    )
    original, quantized_mixin = class_parts(module)
    module.__class__ = module_class(original, quantized_mixin, policy=True)


def uninstall(module: torch.nn.Module) -> None:
    """Restores the module's own class and drops the policy state."""
    if isinstance(module, PolicyModule):
        original, quantized_mixin = class_parts(module)
        module.__class__ = module_class(original, quantized_mixin, policy=False)
    for key in STATE_KEYS:
        module.__dict__.pop(key, None)
