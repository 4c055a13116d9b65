"""The call core for any torch module: `PolicyModule`, the mixin put in front
of a module's class, and the per-module stack of policy applications.

Each application (an `apply_policy` handle, or `quantize()` on a plain module)
pushes `(token, ModuleOptions)` on the module's stack; the top entry decides
the module's `CallState`. Removing an application takes its entry out
wherever it is, so nested applications compose: the most recent one wins,
and removing it brings back the one below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies._core import sharded
from dtype_policies._core.call import read_weight, run_call
from dtype_policies._core.casting import HALF_DTYPES, tracing
from dtype_policies._core.checkpoints import check_checkpoint
from dtype_policies._core.compose import mixins_of, original_class, set_mixins
from dtype_policies._core.products import linear_product
from dtype_policies._core.state import CallState, derive_call_state
from dtype_policies._core.weight_casts import WeightCasts, cast_pair
from dtype_policies.policies import DTypePolicy, policy_for_config


@dataclass(frozen=True)
class ModuleOptions:
    """How one application treats one module.

    Attributes:
        policy: The module's float (or quantized) policy.
        island: Compute in float32 and hand outputs back in the caller's dtype.
        half_inputs_ok: (islands) its CPU kernel takes half inputs directly.
        norm: A normalization layer: its own parameters and buffers are never
            cast (running statistics stay float32 and keep updating); its
            outputs are in the compute dtype.
        gather: Its weights are looked up, not multiplied (embeddings).
        cast_buffers: Read floating buffers in the compute dtype too.
        weight_cache: Keep graph-free casts between calls (see `weight_casts`).
    """

    policy: DTypePolicy
    island: bool = False
    half_inputs_ok: bool = False
    norm: bool = False
    gather: bool = False
    cast_buffers: bool = True
    weight_cache: bool = True


class PolicyModule:
    """The mixin that runs a torch module's calls by its policy."""

    _dp_order = 0
    _dp_per_class = ("__call__",)  # see compose._own_copy

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The policy this module computes by (quantized when it is)."""
        return self.__dict__["_dp_state"].policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get("_dp_state")
        if state is None:  # built by the module's own code (a slice of a Sequential)
            return super().__call__(*args, **kwargs)
        return run_call(state, super().__call__, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        state = d.get("_dp_state")
        if state is not None and name in state.weight_names:
            is_buffer = name in state.buffer_names
            value = (d["_buffers"] if is_buffer else d["_parameters"]).get(name)
            if value is not None:
                if sharded.as_is(d, value):  # FSDP2 reading its sharded parameter
                    return value
                return read_weight(d.get("_dp_casts"), name, value, is_buffer)
        return super().__getattr__(name)

    _is_fsdp_managed_module = sharded.fsdp_managed

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_checkpoint(self, state_dict, prefix)  # the whole subtree, before any of it loads
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # `.to()`, `.half()`, ... may change weight dtypes: re-derive the state.
        result = super()._apply(fn, *args, **kwargs)
        if "_dp_stack" in self.__dict__:
            refresh(self)
        return result


class FastLinearForward:
    """The forward of an exact `nn.Linear` under a policy: it reads its weights
    in the compute dtype itself (a leaf needs no autocast scope), which keeps
    the call cost of small layers low."""

    _dp_order = 10

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        d = self.__dict__
        state = d.get("_dp_state")
        parameters = d["_parameters"]
        weight, bias = parameters["weight"], parameters["bias"]
        if state is not None and state.autocast and weight.dtype is not state.compute:
            weight, bias, product = cast_pair(
                d.get("_dp_casts"), weight, bias, state.compute, pack=True
            )
            if product is not None:  # the path this CPU runs it by (`_core.products`)
                return product(input, bias)
            if input.dim() > 2:
                # A kept cast does not require grad, and for such weights torch's
                # matmul turns a strided 3-D input (the last position of a
                # sequence) into a batched product that copies the whole weight:
                # fold to 2-D here.
                out = F.linear(input.reshape(-1, input.shape[-1]), weight, bias)
                return out.view(*input.shape[:-1], out.shape[-1])
        elif state is not None and state.compute in HALF_DTYPES and not tracing():
            # Weights already in the compute dtype (sharded or half-precision
            # parameters) take the same product path as cast ones.
            product = linear_product(weight, kept=False)
            if product is not None:
                return product(input, bias)
        return F.linear(input, weight, bias)


FAST_LINEARS = (torch.nn.Linear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)


def install(
    module: torch.nn.Module, token: object, options: ModuleOptions, bottom: bool = False
) -> None:
    """Pushes an application on the module's stack (at the bottom with
    `bottom`, for permanent entries such as `quantize()`'s) and refreshes it."""
    stack = module.__dict__.setdefault("_dp_stack", [])
    if bottom:
        stack.insert(0, (token, options))
    else:
        stack.append((token, options))
    refresh(module)


def uninstall(module: torch.nn.Module, token: object) -> bool:
    """Removes the application `token` from the module; returns whether it had one."""
    stack = module.__dict__.get("_dp_stack")
    if not stack:
        return False
    remaining = [entry for entry in stack if entry[0] is not token]
    if len(remaining) == len(stack):
        return False
    if remaining:
        module.__dict__["_dp_stack"] = remaining
        refresh(module)
    else:
        for key in ("_dp_stack", "_dp_state", "_dp_casts"):
            module.__dict__.pop(key, None)
        set_mixins(
            module,
            tuple(m for m in mixins_of(module) if m not in (PolicyModule, FastLinearForward)),
        )
    return True


def top_options(module: torch.nn.Module) -> ModuleOptions | None:
    stack = module.__dict__.get("_dp_stack")
    return stack[-1][1] if stack else None


def refresh(module: torch.nn.Module) -> None:
    """Re-derives the module's call state from the top of its stack."""
    options = module.__dict__["_dp_stack"][-1][1]
    module.__dict__["_dp_state"] = module_call_state(module, options)
    casts = module.__dict__.get("_dp_casts")
    keep = sharded.keeps_casts(module, options.weight_cache)
    if casts is None or casts.enabled != keep:
        module.__dict__["_dp_casts"] = WeightCasts(keep)
    else:
        casts.clear()
    quantization = module.__dict__.get("_dp_quant")
    mixins = set(mixins_of(module)) | {PolicyModule}
    if quantization is None and original_class(module) in FAST_LINEARS:
        mixins.add(FastLinearForward)
    else:
        mixins.discard(FastLinearForward)
    set_mixins(module, tuple(mixins))


def module_call_state(module: torch.nn.Module, options: ModuleOptions) -> CallState:
    """The `CallState` of a torch module under `options` (quantized modules
    compute by the quantized policy of their mode on the options' policy)."""
    policy = options.policy
    quantization = module.__dict__.get("_dp_quant")
    stored: frozenset[str] = frozenset()
    if quantization is not None:
        source = getattr(policy, "source_name", policy.name)
        policy = policy_for_config(quantization.config, source)
        stored = quantization.stored_names
    elif policy.quantization_mode is not None:  # a module that cannot be quantized
        policy = policy.source_policy
    parameters = {
        name: p for name, p in module._parameters.items() if p is not None and name not in stored
    }
    buffers = {
        name: b for name, b in module._buffers.items() if b is not None and name not in stored
    }
    weight_names: set[str] = set()
    buffer_names: set[str] = set()
    if not options.norm:
        # Gather modules read their tables in their own dtype (their calls
        # disable casting), but a parent reading a table gets it cast.
        weight_names.update(n for n, p in parameters.items() if p.is_floating_point())
    if options.cast_buffers and not (options.norm or options.gather or options.island):
        buffer_names.update(n for n, b in buffers.items() if b.is_floating_point())
        weight_names |= buffer_names
    gather_dtype = None
    if options.gather:
        weight = parameters.get("weight")
        gather_dtype = weight.dtype if weight is not None else None
        if quantization is not None:
            gather_dtype = torch.float32
    has_weights = next(module.parameters(), None) is not None or (
        next(module.buffers(), None) is not None
    )
    return derive_call_state(
        policy,
        autocast=not options.gather,
        has_weights=has_weights,
        weight_names=frozenset(weight_names),
        buffer_names=frozenset(buffer_names),
        island=options.island,
        half_inputs_ok=options.half_inputs_ok,
        gather_dtype=gather_dtype,
        output_compute=options.norm,
        casts_own_weights=quantization is not None or original_class(module) in FAST_LINEARS,
    )


def is_policied(module: torch.nn.Module) -> bool:
    """Whether the module is prepared by `apply_policy` or `quantize()`."""
    return "_dp_stack" in module.__dict__
