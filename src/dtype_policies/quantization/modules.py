"""The forwards quantized torch modules get, and how quantized modules load
state dicts.

A quantized `nn.Linear` (or any registered linear kind) computes
`x @ W + bias` with the quantized weight; a quantized `nn.Embedding` looks its
rows up. Reading the quantized weight's attribute (`module.weight`) gives the
dequantized float weight, so a parent module that reads `child.weight`
directly keeps computing correctly (slowly); writes to it raise
(`weight_copy`).

A quantized module computes in its own float dtype (the dtype of the weight it
replaced) unless a policy application above says otherwise; `.to(dtype)`,
`.half()`, `.bfloat16()` ... change that own dtype as they would the float
weight's, so a model quantized in part and then cast keeps computing in one
dtype (where the mode refuses the new dtype, int8 and float16, the module
computes in float32 and hands its outputs back in it). The stored tensors
never change dtype.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from dtype_policies._core.call import leaf_weights
from dtype_policies._core.checkpoints import check_before_loading, loads_as_torch
from dtype_policies._core.module_state import (
    ModuleState,
    Token,
    ensure_state,
    forget_kept_after_load,
    quantization_of,
    state_of,
)
from dtype_policies._core.policy_module import ModuleOptions
from dtype_policies._core.scope import current_scope
from dtype_policies._modes import mode_record
from dtype_policies.policies import DTypePolicy
from dtype_policies.quantization.deferred_read import compute_pending_reads, deferred
from dtype_policies.quantization.schemes.base import (
    QuantizedWeight,
    not_prepared,
    quantize_by_outputs,
)
from dtype_policies.quantization.weight_guard import QuantizedWeightGuard

# The application `quantize()` puts at the bottom of a quantized module's
# stack: its own float dtype, in force when no policy application is above it.
QUANTIZE_TOKEN = Token("QUANTIZE_TOKEN")


def own_options(mode: str, dtype: torch.dtype) -> ModuleOptions:
    """The bottom application of a module quantized in `mode` whose float
    weights are `dtype` (the weight it replaced, as conversions of the model
    since left it): it computes in `dtype`, or, where the mode refuses to
    (int8 and float16), in float32 and hands its outputs back in `dtype`, so
    that the modules around it (a float16 `LayerNorm`) take them."""
    name = str(dtype).removeprefix("torch.")
    if computes_in(mode, dtype):
        return ModuleOptions(policy=DTypePolicy(name))
    return ModuleOptions(policy=DTypePolicy("float32"), outputs=name)


def computes_in_own_dtype(module: torch.nn.Module) -> bool:
    """Whether a quantized module computes in its own float dtype: no policy
    applied above `quantize()`'s own application, so that it follows a
    conversion of the model's dtype (`.to()`, `from_pretrained(dtype=...)`)."""
    state = state_of(module)
    return (
        state is not None
        and bool(state.applications)
        and state.applications[-1][0] is QUANTIZE_TOKEN
    )


def _bias(
    module: torch.nn.Module, state: ModuleState, qw: QuantizedWeight, compute: torch.dtype
) -> torch.Tensor | None:
    name = qw.spec.bias
    if not name:
        return None
    parameters = module._parameters
    # a parametrized bias (`torch.nn.utils.parametrize`) is read through its property
    bias = parameters[name] if name in parameters else getattr(module, name, None)
    if bias is None or bias.dtype == compute:
        return bias
    return leaf_weights(state.casts, bias, None, compute, weight_name=name)[0]


class QuantizedForward(QuantizedWeightGuard):
    """Shared by the quantized forwards: the weight attribute (read
    dequantized, a copy whose writes raise: `weight_copy`; assigning it
    refused: `weight_guard`) and loading."""

    _dp_order = 10

    def __getattr__(self, name: str) -> Any:
        qw = quantization_of(self)
        if qw is not None and name == qw.weight_name and not qw.scheme.keeps_float_weight:
            scope = current_scope()
            dtype = scope.dtype if scope is not None and scope.dtype is not None else None
            return deferred(self, qw, dtype or qw.float_dtype)
        return super().__getattr__(name)

    @loads_as_torch
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        qw = quantization_of(self)
        if qw is not None:
            compute_pending_reads(self, qw)  # before the stored tensors are written
            check_before_loading(self, state_dict, prefix, args, kwargs)
            adapt_state_dict(self, qw, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        forget_kept_after_load(self)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return apply_keeping_stored_dtypes(self, fn, super()._apply, args, kwargs)


class QuantizedLinearForward(QuantizedForward):
    """`x @ W + bias` with the quantized weight, in the module's compute dtype."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = state_of(self)
        call = None if state is None else state.call
        if state is None or call is None or call.compute is None:
            raise not_prepared(self)
        compute = call.compute
        qw: QuantizedWeight = state.quantization
        return qw.linear(self, input, _bias(self, state, qw, compute), compute)

    def extra_repr(self) -> str:
        qw = quantization_of(self)
        spec = qw.spec
        return (
            f"in_features={spec.in_features}, out_features={spec.out_features}, "
            f"bias={spec.bias is not None}, quantization={qw.mode}"
        )


class QuantizedEmbeddingForward(QuantizedForward):
    """Rows looked up in the quantized table, in the module's compute dtype."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.dtype not in (torch.int32, torch.int64):  # as nn.Embedding's own check
            raise RuntimeError(
                "Expected tensor for argument #1 'indices' to have one of the following "
                f"scalar types: Long, Int; but got {input.dtype} instead (while checking "
                "arguments for embedding)"
            )
        state = state_of(self)
        call = None if state is None else state.call
        if state is None or call is None or call.compute is None:
            raise not_prepared(self)
        return state.quantization.lookup(self, input, call.compute)

    def extra_repr(self) -> str:
        qw = quantization_of(self)
        return f"{qw.spec.out_features}, {qw.spec.in_features}, quantization={qw.mode}"


class QuantizedScaledEmbeddingForward(QuantizedEmbeddingForward):
    """Rows looked up in the quantized table times the module's `embed_scale`
    (transformers' scaled word embeddings: Gemma's, BART's), a tensor read in
    the table's float dtype as their forward reads it."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        scale = self.embed_scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(quantization_of(self).float_dtype)
        return super().forward(input) * scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaled"


FORWARDS = {
    "linear": QuantizedLinearForward,
    "embedding": QuantizedEmbeddingForward,
    "scaled_embedding": QuantizedScaledEmbeddingForward,
}


def apply_keeping_stored_dtypes(
    module: torch.nn.Module, fn: Any, module_apply: Any, args: tuple, kwargs: dict
) -> Any:
    """`module._apply(fn)` (`.to()`, `.half()`, `.cuda()`, ...) that moves the
    quantized state between devices but never changes its dtypes: integer data
    stays integer and scales stay float32, whatever `.half()` or `.to(dtype)`
    asks (a float16 scale of a small weight would overflow)."""
    qw = quantization_of(module)
    if qw is None:
        return module_apply(fn, *args, **kwargs)
    buffers = module._buffers
    stored = {name: tensor for name in qw.stored_names if (tensor := buffers.get(name)) is not None}
    device = next((t.device for t in stored.values() if t is not None), None)
    # what the float weight would become (an empty probe: nothing is touched yet)
    float_dtype = fn(torch.empty(0, dtype=qw.float_dtype, device=device)).dtype
    for name in stored:
        buffers[name] = None  # `Module._apply` skips these
    try:
        result = module_apply(fn, *args, **kwargs)
    finally:
        for name, tensor in stored.items():
            moved = fn(tensor)
            if moved.dtype != tensor.dtype:
                moved = tensor.to(device=moved.device)
            buffers[name] = moved
    if float_dtype != qw.float_dtype and float_dtype.is_floating_point:
        _follow_float_dtype(module, qw, float_dtype)
    return result


def computes_in(mode: str, dtype: torch.dtype) -> bool:
    """Whether `mode` computes in the float `dtype` (int8 refuses float16)."""
    try:
        mode_record(mode).check_compute_dtype(str(dtype).removeprefix("torch."))
    except ValueError:
        return False
    return True


def _follow_float_dtype(module: torch.nn.Module, qw: QuantizedWeight, dtype: torch.dtype) -> None:
    """Makes `dtype` the module's own float dtype (its bottom application,
    `own_options`)."""
    qw.float_dtype = dtype
    state = ensure_state(module)
    state.applications = [
        (token, own_options(qw.mode, dtype) if token is QUANTIZE_TOKEN else entry)
        for token, entry in state.applications
    ]
    cast(Any, module)._refresh_policy_state()


def adapt_state_dict(
    module: torch.nn.Module, qw: QuantizedWeight, state_dict: dict, prefix: str
) -> None:
    """Makes a checkpoint loadable into a quantized module, in `state_dict`:

    * a float checkpoint (the float `<weight>` instead of the stored buffers)
      is quantized with the module's own mode and config;
    * stored buffers of another mode or layout raise `ValueError` naming the
      keys (`QuantizedWeight.check_checkpoint`);
    * float8 scaling state missing from a float checkpoint (none of it
      there) keeps its values; a checkpoint holding part of it leaves the
      rest missing, for torch to report (`missing_keys`, an error when strict).
    """
    qw.check_checkpoint(module, state_dict, prefix)
    qw.scheme.upgrade_checkpoint(qw.spec, qw.config, state_dict, prefix)
    weight_key = prefix + qw.weight_name
    present = [prefix + name for name in qw.stored_names if prefix + name in state_dict]
    if present:
        qw.placeholder = None  # a checkpoint's tensors replace the placeholders
    if qw.scheme.keeps_float_weight:
        if not present:
            for name in qw.stored_names:
                # `attach` registers float8's scaling state as tensors
                state_dict[prefix + name] = cast(torch.Tensor, module._buffers[name]).detach()
        return
    if weight_key in state_dict and not present:
        value = state_dict[weight_key]
        if not isinstance(value, torch.Tensor) or value.is_complex():
            return
        if not value.is_floating_point():  # an integer weight: cast, as a float parameter's copy_
            value = value.to(qw.float_dtype)
        # its shape and values were checked with the stored tensors (check_checkpoint)
        with torch.no_grad(), torch.inference_mode(False):
            tensors = quantize_by_outputs(qw.scheme, value.detach(), qw.spec, qw.config)
        del state_dict[weight_key]
        for name, tensor in tensors.items():
            state_dict[prefix + name] = tensor
