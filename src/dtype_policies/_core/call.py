"""The one call body of every policied module (`Layer`s and the modules
`apply_policy` prepares), and the one way weights are read inside it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._compat import fx_symbolic_tracing
from dtype_policies._core.casting import (
    HALF_DTYPES,
    cast_floating,
    cast_inputs,
    cast_tensor,
    first_tensor,
    tracing,
)
from dtype_policies._core.cpu_float16 import warn_if_cpu_float16
from dtype_policies._core.fx_calls import fx_proxy, record_module_call
from dtype_policies._core.scope import call_in_scope, current_scope, scope_for_call
from dtype_policies._core.state import CallState
from dtype_policies._core.torch_autocast import autocast_active, call_without_autocast
from dtype_policies._core.weight_casts import WeightCasts, cast_weight
from dtype_policies._derivatives import derivative_free, functorch_active

# torch's CPU layer_norm given half inputs and float32 weights sums the weight
# and bias gradients over the rows in the half dtype (bfloat16: 2% off at 512
# rows, 6% at 4096); its input gradient, and the other norms' gradients, are
# float32-exact. Its half-input kernel is used only when nothing asks for them.
_HALF_INPUT_WEIGHT_GRADS_INEXACT = (torch.nn.LayerNorm,)


def half_input_kernel_usable(module: torch.nn.Module | None, first: torch.Tensor) -> bool:
    """Whether a norm whose CPU kernel takes half inputs with float32 weights
    (`CallState.half_inputs_ok`) may be given `first`'s dtype as it is."""
    if first.dtype not in HALF_DTYPES or first.device.type != "cpu":
        return False
    if functorch_active():  # those kernels have no batching rule (they have derivatives)
        return False
    if torch.is_grad_enabled() and isinstance(module, _HALF_INPUT_WEIGHT_GRADS_INEXACT):
        return derivative_free(*module._parameters.values())
    return True


def run_call(
    state: CallState,
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    module: torch.nn.Module | None = None,
) -> Any:
    """Calls `call(*args, **kwargs)` as `state` says: floating arguments cast,
    inside the right autocast scope, outputs cast back where needed; the
    policy decides the dtypes, not an enclosing `torch.autocast`."""
    if autocast_active():
        return call_without_autocast(run_call, state, call, args, kwargs)
    if state.leaf_fast_path and not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        # The common leaf call (one tensor in, weights cast by the forward).
        x = args[0]
        if x.dtype is not state.inputs and x.is_floating_point():
            x = cast_tensor(x, state.inputs)
        return call(x)
    if fx_symbolic_tracing():
        proxy = fx_proxy(args, kwargs)
        if proxy is not None:
            return record_module_call(proxy, call, args, kwargs)
    cast_to = state.inputs
    restore = None
    if state.island:
        first = first_tensor((args, kwargs), floating=True)
        if first is not None and first.dtype != cast_to:
            if state.half_inputs_ok and half_input_kernel_usable(module, first):
                # torch's mixed-dtype norm kernels compute float32 statistics from
                # half inputs and return half outputs: no extra passes needed.
                cast_to = None
            else:
                restore = first.dtype
    if cast_to is not None or state.convert_arrays:
        forward = None
        if module is not None and len(args) > 1:
            # the method whose signature names the arguments (a Keras-style
            # layer's `call`: its `forward` takes `*args`)
            named_by = getattr(type(module), "_arguments_named_by", None)
            forward = named_by(module) if named_by is not None else module.forward
        args, kwargs = cast_inputs(args, kwargs, cast_to, forward)
    if state.warn_cpu_float16:
        first = first_tensor((args, kwargs), floating=True)
        if first is not None:
            warn_if_cpu_float16(first.device)
    scope = (
        None
        if state.casts_own_weights
        else scope_for_call(state.compute, state.autocast, state.has_weights)
    )
    try:
        outputs = call_in_scope(call, scope, args, kwargs)
    except RuntimeError as error:
        # the innermost policied call the error leaves says what its own code met
        if not getattr(error, "_policied_call_seen", False):
            error._policied_call_seen = True  # type: ignore[attr-defined]
            _note_wider_outputs(error, module, state)
            _note_sharded_read(error)
        raise
    if restore is not None:
        return cast_floating(outputs, restore)
    if state.outputs is not None:
        if state.outputs_in_calls and current_scope() is None:
            return outputs
        return cast_floating(outputs, state.outputs)
    return outputs


def _note_wider_outputs(
    error: RuntimeError, module: torch.nn.Module | None, state: CallState
) -> None:
    """A dtype error inside `module`'s own code, where a submodule computing
    in a wider dtype (a float32 map entry) kept its outputs, as Keras's do:
    torch's ops (`matmul`, `cat`) refuse the mix that Keras's promote. The
    error gets a note naming those submodules and the way out."""
    if module is None or state.compute is None or not hasattr(error, "add_note"):
        return
    if "type" not in str(error):  # "same dtype", "expected scalar type Float"
        return
    from dtype_policies._core.module_state import state_of  # the call path stays lean

    wider = []
    for path, submodule in module.named_modules():
        sub_state = state_of(submodule) if path else None
        call_state = getattr(sub_state, "call", None)
        if (
            call_state is not None
            and not call_state.island
            and call_state.outputs is None
            and call_state.compute is not None
            and call_state.compute.itemsize > state.compute.itemsize
            and _names_dtype(str(error), call_state.compute)
        ):
            wider.append(f"'{path}' ({call_state.policy.name})")
    if not wider:
        return
    named = ", ".join(wider[:3]) + (" and more" if len(wider) > 3 else "")
    verbs = "computes in a wider dtype and keeps its"
    if len(wider) > 1:
        verbs = "compute in a wider dtype and keep their"
    error.add_note(
        f"dtype_policies: inside {type(module).__name__}, which computes in "
        f"{str(state.compute).removeprefix('torch.')}, {named} {verbs} outputs, as Keras's "
        "layers do; torch's ops do not promote mixed float dtypes as Keras's do. Give the "
        "modules whose outputs meet the same policy (or their parent the wider one)."
    )


_DTYPE_WORDS = {
    torch.float32: r"\b(float|float32)\b",
    torch.float64: r"\b(double|float64)\b",
    torch.float16: r"\b(half|float16)\b",
    torch.bfloat16: r"\bbfloat16\b",
}


def _names_dtype(message: str, dtype: torch.dtype) -> bool:
    """Whether a torch error message names `dtype` ("Float", "c10::BFloat16")."""
    words = _DTYPE_WORDS.get(dtype)
    return words is not None and re.search(words, message, re.IGNORECASE) is not None


def _note_sharded_read(error: RuntimeError) -> None:
    """FSDP2's "got mixed torch.Tensor and DTensor": a module's parameters
    read outside its own forward (by its parent) while its unit keeps them
    sharded. The error gets a note naming `fully_shard`'s way out."""
    if not hasattr(error, "add_note") or "mixed torch.Tensor and DTensor" not in str(error):
        return
    error.add_note(
        "dtype_policies: a parameter read here is still sharded. FSDP2 gathers a unit's "
        "parameters around that unit's own forward; a module whose parent reads its "
        "parameters itself (F.linear(h, self.wte.weight)) must share its parent's unit: "
        "name it in dtype_policies.distributed.fully_shard(..., read_by_parent=[...])."
    )


def read_weight(
    store: WeightCasts | None, name: str, value: torch.Tensor, is_buffer: bool
) -> torch.Tensor:
    """A weight read inside a call: in the active scope's dtype when there is
    one. Parameters may come from `store`; buffers are cast per call (and an
    in-place update of the cast reaches the buffer)."""
    scope = current_scope()
    if scope is None or scope.dtype is None or value.dtype == scope.dtype:
        return value
    if not value.is_floating_point():
        return value
    if is_buffer:
        return scope.cast_buffer(value)
    if tracing():  # the recording holds the writes as they are
        return cast_weight(store, name, value, scope.dtype, scope)
    if scope._handed:
        scope.settle(value)  # a copy of it written earlier in the call: `value` has it
    cast = cast_weight(store, name, value, scope.dtype, scope)
    scope.hand(value, cast)  # a write to it in the call reaches `value`
    return cast


def leaf_weights(
    store: WeightCasts | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    weight_name: str = "weight",
    bias_name: str = "bias",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A leaf module's weight and bias in `dtype`, for forwards that cast their
    own weights (no scope of their own; an enclosing scope of the same dtype
    still deduplicates the casts)."""
    scope = current_scope()
    if scope is not None and scope.dtype is not dtype:
        scope = None
    weight = cast_weight(store, weight_name, weight, dtype, scope)
    if bias is not None:
        bias = cast_weight(store, bias_name, bias, dtype, scope)
    return weight, bias
