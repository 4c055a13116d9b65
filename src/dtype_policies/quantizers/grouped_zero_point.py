"""Keras's `abs_max_quantize_grouped_with_zero_point`: asymmetric quantization
of a `(rows, columns)` matrix in groups of rows, with Keras's numerics (the
library's own int4 path uses `grouped_quantize_with_zero_point`, whose zero
point is chosen differently)."""

from __future__ import annotations

import math

import torch

from dtype_policies.quantizers.math import EPSILON, _torch_dtype


def abs_max_quantize_grouped_with_zero_point(
    inputs: torch.Tensor,
    block_size: int,
    value_range: tuple[int, int] = (-8, 7),
    dtype: str | torch.dtype = "int8",
    epsilon: float = EPSILON,
    to_numpy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, scale, zero_point)` with `q = clip(round(x / scale) + zero, *value_range)`
    per group of `block_size` rows and per column; `scale` and `zero_point`
    of shape `(groups, columns)`, `zero_point` int8. A short last group is
    padded with zeros (which count in its minimum and maximum when there are
    several groups), as in Keras.
    Keras's tensor path widens a group whose values are all equal by 1 on
    each side; its NumPy path (`to_numpy=True`) does not, and neither does
    this with `to_numpy=True` (computed in torch all the same).

    >>> import torch
    >>> w = torch.tensor([[0.0, -1.0], [1.5, 1.0], [3.0, 0.0], [1.0, 2.0]])
    >>> q, scale, zero = abs_max_quantize_grouped_with_zero_point(w, block_size=2)
    >>> q
    tensor([[-8, -8],
            [ 7,  6],
            [ 7, -8],
            [-1,  7]], dtype=torch.int8)
    >>> scale.shape, zero.dtype
    (torch.Size([2, 2]), torch.int8)
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer. Received: {block_size}")
    inputs = torch.as_tensor(inputs)
    if inputs.ndim != 2:
        raise ValueError(
            f"abs_max_quantize_grouped_with_zero_point takes a 2D tensor. "
            f"Received shape {tuple(inputs.shape)}"
        )
    rows, columns = inputs.shape
    low, high = value_range
    groups = math.ceil(rows / block_size)
    padded = torch.nn.functional.pad(inputs, (0, 0, 0, groups * block_size - rows))
    blocks = padded.reshape(groups, block_size, columns)
    # Keras's tensor path pads only when there are several groups
    stats = inputs[None] if groups == 1 and not to_numpy else blocks
    minimum, maximum = stats.amin(dim=1), stats.amax(dim=1)
    if not to_numpy:
        flat = minimum == maximum
        minimum, maximum = minimum - flat.to(minimum.dtype), maximum + flat.to(maximum.dtype)
        levels = 2 ** int(math.log2(high - low + 1)) - 1
    else:
        levels = high - low
    value_span = maximum - minimum + epsilon if epsilon > 0 or to_numpy else maximum - minimum
    scale = value_span / levels
    if not to_numpy:
        scale = torch.where(scale <= 0, torch.full_like(scale, 1e-8), scale)
    zero = torch.clamp(torch.round(-minimum / scale) + low, low, high)
    q = torch.round(blocks / scale[:, None]) + zero[:, None]
    q = torch.clamp(q, low, high).to(_torch_dtype(dtype))
    return q.reshape(groups * block_size, columns)[:rows], scale, zero.to(torch.int8)
