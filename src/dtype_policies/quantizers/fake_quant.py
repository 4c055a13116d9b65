"""Keras's `fake_quant_with_min_max_vars`: quantize to `num_bits` levels
between trainable bounds and dequantize, with TensorFlow's gradients."""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._derivatives import transform_active


def _nudged_range(
    min_range: torch.Tensor, max_range: torch.Tensor, num_bits: int, narrow_range: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keras's `adjust_and_nudge`: the bounds moved so that 0 is a grid value."""
    compute = torch.promote_types(min_range.dtype, torch.float32)
    min_range, max_range = min_range.to(compute), max_range.to(compute)
    quant_max = (1 << num_bits) - 1
    quant_min = 1 if narrow_range else 0
    span = max_range - min_range
    scale = span / (quant_max - quant_min)
    inverse_scale = (quant_max - quant_min) / span
    zero_point = torch.round(torch.clamp(quant_min - min_range / scale, quant_min, quant_max))
    return (quant_min - zero_point) * scale, (quant_max - zero_point) * scale, scale, inverse_scale


class _FakeQuant(torch.autograd.Function):
    generate_vmap_rule = True  # its forward is plain ops (`torch.func.vmap`, `jacrev`)

    @staticmethod
    def forward(x, min_vals, max_vals, num_bits, narrow_range, axis):  # type: ignore[override]
        nudged_min, nudged_max, scale, inverse_scale = _nudged_range(
            min_vals, max_vals, num_bits, narrow_range
        )
        quant_zero = torch.floor(-nudged_min * inverse_scale + 0.5)
        clamped = torch.clamp(x.to(nudged_min.dtype), nudged_min, nudged_max)
        shifted = clamped - nudged_min
        result = torch.floor(shifted * inverse_scale - quant_zero + 0.5) * scale
        return result.to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[override]
        # a separate setup_context: what torch.func transforms require
        x, min_vals, max_vals, num_bits, narrow_range, axis = inputs
        nudged_min, nudged_max, _, _ = _nudged_range(min_vals, max_vals, num_bits, narrow_range)
        ctx.save_for_backward(x, nudged_min, nudged_max)
        ctx.save_for_forward(x, nudged_min, nudged_max)
        ctx.axis, ctx.shapes = axis, (min_vals.shape, max_vals.shape)

    @staticmethod
    def backward(ctx: Any, upstream):
        x, nudged_min, nudged_max = ctx.saved_tensors
        zero = torch.zeros_like(upstream)
        inside = (x >= nudged_min) & (x <= nudged_max)
        below, above = (
            torch.where(x <= nudged_min, upstream, zero),
            torch.where(x >= nudged_max, upstream, zero),
        )
        if ctx.axis is None:
            grad_min, grad_max = below.sum(), above.sum()
        else:
            others = [d for d in range(upstream.ndim) if d != ctx.axis]
            grad_min, grad_max = below.sum(dim=others), above.sum(dim=others)
        min_shape, max_shape = ctx.shapes
        return (
            torch.where(inside, upstream, zero),
            grad_min.reshape(min_shape),
            grad_max.reshape(max_shape),
            None,
            None,
            None,
        )


class _FakeQuantTangents(_FakeQuant):
    """`_FakeQuant` with its forward-mode derivatives (Dynamo cannot trace an
    autograd function that defines `jvp`: compiled graphs get `_FakeQuant`)."""

    @staticmethod
    def jvp(ctx: Any, tangent_x, tangent_min, tangent_max, *_: Any):
        """The backward's derivatives in forward mode: `tangent_x` inside the
        range, the bound's tangent at and beyond it."""
        x, nudged_min, nudged_max = ctx.saved_tensors
        tangent = torch.zeros_like(x)
        if tangent_x is not None:
            inside = (x >= nudged_min) & (x <= nudged_max)
            tangent = torch.where(inside, tangent_x, tangent)
        for bound_tangent, at_bound in (
            (tangent_min, x <= nudged_min),
            (tangent_max, x >= nudged_max),
        ):
            if bound_tangent is not None:  # broadcast as the bounds are in the forward
                tangent = tangent + torch.where(at_bound, bound_tangent.to(x.dtype), 0)
        return tangent


def fake_quant_with_min_max_vars(
    inputs: torch.Tensor,
    min_vals: Any,
    max_vals: Any,
    num_bits: int = 8,
    narrow_range: bool = False,
    axis: int | None = None,
) -> torch.Tensor:
    """`inputs` clamped to `[min_vals, max_vals]` (nudged so that 0 is on the
    grid), quantized to `2**num_bits` levels (one fewer with `narrow_range`)
    and dequantized; per channel along `axis`, else per tensor. Gradients:
    straight through inside the range, to `min_vals` / `max_vals` outside.

    >>> import torch
    >>> fake_quant_with_min_max_vars(torch.tensor([-0.3, 0.26, 0.9, 2.0]), 0.0, 1.0, num_bits=2)
    tensor([0.0000, 0.3333, 1.0000, 1.0000])
    """
    inputs = torch.as_tensor(inputs)
    min_vals = torch.as_tensor(min_vals, dtype=torch.float32, device=inputs.device)
    max_vals = torch.as_tensor(max_vals, dtype=torch.float32, device=inputs.device)
    if axis is not None:
        axis = axis % inputs.ndim
    function = _FakeQuantTangents if transform_active() else _FakeQuant
    return function.apply(inputs, min_vals, max_vals, int(num_bits), narrow_range, axis)
