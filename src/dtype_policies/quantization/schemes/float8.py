"""float8 (Keras's `float8` mode): quantize-dequantize training with delayed
(the default, as Keras) or dynamic scaling. The float weight stays a trained
parameter; six float32 buffers hold the delayed-scaling state:
`inputs_scale`, `kernel_scale`, `outputs_grad_scale` (scalars) and their
`*_amax_history` (the policy's length, default 1024).

Weight-only (`Float8QuantizationConfig(scaling="weight_only")`) rounds the
kernel to e4m3fn with a scale per output channel taken from the kernel itself
(per tensor for contractions without an output-channel axis); inputs and
output gradients are not quantized, and the buffers are not used.

Dynamic scaling (`Float8QuantizationConfig(scaling="dynamic")`) takes each
scale from the tensor being quantized, in every call (inputs and kernel in the
forward, the output gradient in the backward): `max|t| / format max`. It
needs no calibration and never reads or writes the six buffers (they stay,
so that checkpoints have one format).

Delayed scaling: in a training step (a forward in training mode and its backward): inputs and
kernel are quantize-dequantized in float8_e4m3fn with the scales from before
the step, the output gradient in float8_e5m2 with its scale; gradients pass
straight through; once the backward has run, each scale becomes
`max(history before the step) / format max` and each history is rolled with
this step's absolute maximum as its newest entry (index 0). Forwards in eval
mode, or without a backward, change nothing. The buffers are never
parameters, so no optimizer and no loss scaler touch them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies._core.call import leaf_weights
from dtype_policies._core.casting import functorch_wrapped, tracing
from dtype_policies._core.module_state import state_of
from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.quantized import QuantizedFloat8DTypePolicy
from dtype_policies.quantization.kernels.float8 import float8_kernel, float8_linear
from dtype_policies.quantization.schemes.base import QuantizedWeight, Scheme, WeightSpec
from dtype_policies.quantizers.config import Float8QuantizationConfig
from dtype_policies.quantizers.math import (
    FLOAT8_E4M3_MAX,
    FLOAT8_E5M2_MAX,
    compute_float8_amax_history,
    compute_float8_channel_scale,
    compute_float8_dynamic_scale,
    compute_float8_scale,
    quantize_and_dequantize,
)

STATE_NAMES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


class Float8Scheme(Scheme):
    mode = "float8"
    keeps_float_weight = True
    general_contraction = True

    def buffer_names(self, spec: WeightSpec, config: Float8QuantizationConfig) -> tuple[str, ...]:
        return STATE_NAMES

    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: Float8QuantizationConfig
    ) -> dict[str, torch.Tensor]:
        state = {}
        for name in STATE_NAMES:
            if name.endswith("history"):
                value = torch.zeros(config.history_length, dtype=torch.float32)
            else:
                value = torch.ones((), dtype=torch.float32)
            state[name] = value.to(weight.device)
        return state

    def stored_shapes(self, spec: WeightSpec, config: Float8QuantizationConfig) -> dict:
        return {
            name: (((config.history_length,) if name.endswith("history") else ()), torch.float32)
            for name in STATE_NAMES
        }

    def dequantize(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        spec = qw.spec
        return spec.nk(spec.matrix(module._parameters[spec.weight].detach().float()))

    def linear(self, module, qw, x2, bias, compute):
        return self.forward(module, qw, x2, bias, compute)

    def forward(self, module, qw, x, bias, compute):
        spec = qw.spec
        weight = module._parameters[spec.weight]
        if _without_graph(x, weight, bias):
            return self._inference(module, qw, x, weight, bias, compute)
        kernel, bias = leaf_weights(
            state_of(module).casts,
            module._parameters[spec.weight],
            bias,
            compute,
            spec.weight,
            spec.bias or "bias",
        )
        if x.dtype != compute and x.is_floating_point():
            x = x.to(compute)
        if spec.contract is not None:
            contract = spec.contract
        elif spec.layout == "in_out":

            def contract(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                matrix = spec.matrix(w)
                return F.linear(a, matrix.t())

        else:
            contract = F.linear
        if qw.config.scaling == "weight_only":
            y = contract(x, weight_only_kernel(spec, kernel))
        else:
            dynamic = qw.config.scaling == "dynamic"
            y = float8_contract(module, x, kernel, contract, module.training, dynamic)
        if bias is not None:
            y = y + bias
        return y.to(compute)

    def _inference(self, module, qw, x, weight, bias, compute):
        """The forward of a call without autograd: the kept kernel (see
        `kernels.float8`); the same values as the graph path."""
        spec = qw.spec
        if bias is not None:
            bias = leaf_weights(state_of(module).casts, bias, None, compute, "bias")[0]
        if x.dtype != compute and x.is_floating_point():
            x = x.to(compute)
        scaling = qw.config.scaling
        stored = None if scaling != "delayed" else module._buffers["kernel_scale"]
        kernel, product = float8_kernel(
            state_of(module).casts,
            f"{spec.weight}:float8",
            weight,
            stored,
            compute,
            None if spec.contract is not None else lambda k: spec.nk(spec.matrix(k)),
            (lambda k: weight_only_kernel(spec, k)) if scaling == "weight_only" else None,
        )
        contract = spec.contract or (lambda a, k: F.linear(a, spec.nk(spec.matrix(k))))
        input_scale = module._buffers["inputs_scale"] if scaling == "delayed" else None
        y = float8_linear(x, input_scale, kernel, product, contract, bias, scaling != "weight_only")
        return y.to(compute)


def _without_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a float8 call builds no autograd graph (so no scale update can
    follow) and runs eagerly on plain tensors."""
    if tracing() or any(functorch_wrapped(t) for t in (x, weight, bias) if t is not None):
        return False
    if not torch.is_grad_enabled():
        return True
    return not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def weight_only_kernel(spec: WeightSpec, kernel: torch.Tensor) -> torch.Tensor:
    """`kernel` rounded to float8_e4m3fn with a scale per output channel (per
    tensor for contractions without one), in its own shape and dtype;
    gradients pass straight through."""
    if spec.contract is not None:
        return _QDQForward.apply(kernel, compute_float8_dynamic_scale(kernel, FLOAT8_E4M3_MAX))
    w_nk = spec.nk(spec.matrix(kernel))
    scale = compute_float8_channel_scale(w_nk, FLOAT8_E4M3_MAX)
    return spec.from_nk(_QDQForward.apply(w_nk, scale))


class _Updates:
    """New scale/history values computed in the forward, written once the
    backward pass that reaches them is over (`commit_after_backward`)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def commit(self) -> None:
        with torch.no_grad():
            for buffer, value in self.pending:
                buffer.copy_(value)
        self.pending = []


def commit_after_backward(updates: _Updates) -> None:
    """Writes `updates` when the running backward pass ends, not in the middle
    of it: activation checkpointing recomputes a layer's forward during the
    backward (after its output gradient's node ran), and that forward must
    read the scales the first one read. Outside a backward pass (or where
    torch has no such callback), at once."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(updates.commit)
    except (RuntimeError, AttributeError):
        updates.commit()


def _next_state(
    x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_scale = compute_float8_scale(history.max(), scale, fmt_max)
    return new_scale, compute_float8_amax_history(x, history)


class _QDQForward(torch.autograd.Function):
    """Forward: quantize-dequantize in e4m3fn. Backward: straight through."""

    generate_vmap_rule = True  # per-sample gradients (`vmap(grad(...))`)

    @staticmethod
    def forward(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return quantize_and_dequantize(x, scale, torch.float8_e4m3fn, x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        pass  # a separate setup_context: what torch.func transforms require

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _QDQGradient(torch.autograd.Function):
    """Forward: identity. Backward: quantize-dequantize the gradient in e5m2
    (with the stored scale, or with its own when `dynamic`), then commit the
    step's scale and history updates (delayed scaling) when the backward pass
    is over."""

    generate_vmap_rule = True  # under torch.func no state is updated: pure

    @staticmethod
    def forward(  # type: ignore[override]
        y: torch.Tensor,
        scale: torch.Tensor,
        history: torch.Tensor,
        updates: _Updates | None,
        dynamic: bool,
    ) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        _, ctx.scale, ctx.history, ctx.updates, ctx.dynamic = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if ctx.dynamic:
            scale = compute_float8_dynamic_scale(grad, FLOAT8_E5M2_MAX)
            qdq = quantize_and_dequantize(grad, scale, torch.float8_e5m2, grad.dtype)
            return qdq, None, None, None, None
        scale, history = ctx.scale, ctx.history
        qdq = quantize_and_dequantize(grad, scale, torch.float8_e5m2, grad.dtype)
        if ctx.updates is not None and grad.numel() > 0:
            updates, ctx.updates = ctx.updates, None  # a second backward commits nothing
            with torch.no_grad():
                new_scale, new_history = _next_state(grad, scale, history, FLOAT8_E5M2_MAX)
            updates.pending += [(scale, new_scale), (history, new_history)]
            commit_after_backward(updates)
        return qdq, None, None, None, None


def float8_contract(
    module: torch.nn.Module,
    inputs: torch.Tensor,
    kernel: torch.Tensor,
    contract: Any,
    training: bool,
    dynamic: bool = False,
) -> torch.Tensor:
    """`contract(qdq(inputs), qdq(kernel))` with the output gradient
    quantize-dequantized. Delayed scaling: with the scales of `module`'s
    state, advanced when `training` and a backward runs (read, never advanced,
    under `torch.func` transforms: they forbid writing to captured tensors).
    `dynamic`: with scales from the tensors themselves, the state untouched."""
    state = module._buffers  # read directly: never through a policy's autocasting
    if dynamic:
        x = _QDQForward.apply(inputs, compute_float8_dynamic_scale(inputs, FLOAT8_E4M3_MAX))
        k = _QDQForward.apply(kernel, compute_float8_dynamic_scale(kernel, FLOAT8_E4M3_MAX))
        y = contract(x, k)
        scale, history = state["outputs_grad_scale"], state["outputs_grad_amax_history"]
        return _QDQGradient.apply(y, scale, history, None, True)
    updates = None
    functional = not tracing() and (functorch_wrapped(inputs) or functorch_wrapped(kernel))
    if training and torch.is_grad_enabled() and inputs.numel() > 0 and not functional:
        updates = _Updates()
        with torch.no_grad():
            for name, tensor, fmt_max in (
                ("inputs", inputs, FLOAT8_E4M3_MAX),
                ("kernel", kernel, FLOAT8_E4M3_MAX),
            ):
                scale = state[f"{name}_scale"]
                history = state[f"{name}_amax_history"]
                new_scale, new_history = _next_state(tensor, scale, history, fmt_max)
                updates.pending += [(scale, new_scale), (history, new_history)]
    x = _QDQForward.apply(inputs, state["inputs_scale"])
    k = _QDQForward.apply(kernel, state["kernel_scale"])
    y = contract(x, k)
    return _QDQGradient.apply(
        y, state["outputs_grad_scale"], state["outputs_grad_amax_history"], updates, False
    )


register_mode(
    QuantizationMode(
        name="float8",
        config_class=Float8QuantizationConfig,
        policy_class=QuantizedFloat8DTypePolicy,
        scheme=Float8Scheme(),
        policy_for_config=lambda config, source: QuantizedFloat8DTypePolicy(
            "float8", source, config.history_length, config.scaling
        ),
    )
)
