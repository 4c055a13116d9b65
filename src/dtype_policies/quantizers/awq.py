"""AWQ's quantization math (pure functions on tensors).

A weight `W` (N, K) is quantized as `W * s` (`s` one scale per input
feature, larger for salient features) on GPTQ's asymmetric 4-bit grid, and
the layer computes `(x / s) @ dequantize(q)ᵀ`, so the effective weight is
`Ŵ = dequantize(quantize(W * s)) / s`. `s = a ** ratio`, normalised by
`sqrt(max * min)`, with `a` each feature's activation magnitude and `ratio`
the best of `0, 1/n, ..., 1`:

* `awq_search_optimal_scales` / `awq_quantize_matrix`: Keras 3.15's search,
  `a` the maximum |x| and the loss `mean((W - Ŵ)² * a²)` (a weight error);
* `awq_search_output` / `awq_quantize_output`: the original AWQ's criterion,
  the layer's output error on the calibration inputs, exactly
  `tr((W - Ŵ) H (W - Ŵ)ᵀ)` with `H` the inputs' second moment `XᵀX / n`,
  `a` the mean |x`; then the original AWQ's clipping search: each group's
  range clamped to `±c * max|w|` for the `c` (1 down to 0.55) with the least
  output error of that group (its inputs' block of `H`).

>>> import torch
>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> w = torch.randn(16, 64)
>>> x = torch.randn(512, 64) * torch.linspace(0.1, 4.0, 64)
>>> q, scale, zero, s, g_idx = awq_quantize_output(w, x.T @ x / 512, x.abs().mean(0), group_size=32)
>>> q.shape, scale.shape, s.shape
(torch.Size([16, 64]), torch.Size([16, 2]), torch.Size([64]))
>>> w_awq = dequantize_with_sz_map(q, scale, zero, g_idx) / s
>>> w_rtn = dequantize_with_sz_map(*quantize_rtn(w, bits=4, group_size=32))
>>> bool(((x @ (w - w_awq).T) ** 2).sum() < ((x @ (w - w_rtn).T) ** 2).sum())
True
"""

from __future__ import annotations

import torch

from dtype_policies.quantizers.gptq import (
    GRIDS,
    compute_quantization_parameters,
    dequantize_with_sz_map,
    quantize_rtn,
    quantize_with_zero_point,
    refit_grid,
    silent_as_typical,
)
from dtype_policies.quantizers.math import dequantize_grouped, grouped_quantize_with_zero_point

AWQ_BITS = 4
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # the original AWQ's: 1.0 .. 0.55


def _normalised_scales(magnitude: torch.Tensor, ratio: float) -> torch.Tensor:
    scales = torch.ones_like(magnitude) if ratio == 0 else torch.pow(magnitude, ratio)
    scales = torch.clamp(scales, min=1e-4)
    mean = torch.clamp(torch.sqrt(scales.max() * scales.min()), min=1e-8)
    return scales / mean


def _keras_round_trip(
    weights: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keras's AWQ quantization of already scaled weights: `(q, scale, zero, g_idx)`."""
    in_features = weights.shape[1]
    if group_size == -1:
        scale, zero, maxq = compute_quantization_parameters(
            weights, bits=AWQ_BITS, per_channel=True, group_size=-1
        )
        return (
            quantize_with_zero_point(weights, scale, zero, maxq),
            scale,
            zero,
            torch.zeros(in_features, dtype=torch.int64),
        )
    scale, zero, maxq = compute_quantization_parameters(
        weights, bits=AWQ_BITS, per_channel=True, group_size=group_size
    )
    g_idx = torch.arange(in_features) // group_size
    q = quantize_with_zero_point(weights, scale[:, g_idx], zero[:, g_idx], maxq)
    return q, scale, zero, g_idx


def awq_search_optimal_scales(
    w_nk: torch.Tensor,
    activation_magnitudes: torch.Tensor,
    *,
    num_grid_points: int = 20,
    group_size: int = -1,
) -> torch.Tensor:
    """Keras's AWQ scale search (the weight error weighted by `a²`)."""
    weights = w_nk.float()
    x_max = activation_magnitudes.float()
    x_max = torch.where(x_max < 1e-8, torch.ones_like(x_max), x_max)
    best_loss = None
    best = torch.ones(weights.shape[1])
    for i in range(num_grid_points + 1):
        scales = _normalised_scales(x_max, i / num_grid_points)
        scaled = weights * scales
        q, scale, zero, g_idx = _keras_round_trip(scaled, group_size)
        reconstructed = dequantize_with_sz_map(q, scale, zero, g_idx) / scales
        loss = torch.mean(torch.square(weights - reconstructed) * torch.square(x_max))
        if best_loss is None or loss < best_loss:
            best_loss, best = loss, scales
    return best


def awq_quantize_matrix(
    w_nk: torch.Tensor,
    activation_magnitudes: torch.Tensor,
    *,
    num_grid_points: int = 20,
    group_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keras's `awq_quantize_matrix`: `(q, scale, zero, awq_scales, g_idx)`,
    unsigned levels (N, K), (N, G) scales and zero points (float32; Keras
    casts the zero points to uint8, see `compute_quantization_parameters`)."""
    scales = awq_search_optimal_scales(
        w_nk, activation_magnitudes, num_grid_points=num_grid_points, group_size=group_size
    )
    q, scale, zero, g_idx = _keras_round_trip(w_nk.float() * scales, group_size)
    return q, scale, zero, scales, g_idx


def _output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """`tr(D H Dᵀ)`: the squared output error of the weight error `D` on inputs
    with second moment `H`."""
    return ((delta @ hessian) * delta).sum()


def _rule_round_trip(weights: torch.Tensor, group: int) -> torch.Tensor:
    """`weights` (N, K) through int4's round-to-nearest rule in groups of
    `group` inputs (`quantizers.math.grouped_quantize_with_zero_point`)."""
    kernel = weights.t()
    return dequantize_grouped(*grouped_quantize_with_zero_point(kernel, group), group).t()


def awq_search_output(
    w_nk: torch.Tensor,
    hessian: torch.Tensor,
    mean_abs: torch.Tensor,
    *,
    num_grid_points: int = 20,
    group_size: int = -1,
    grid: str = "refined",
) -> torch.Tensor:
    """The original AWQ's scale search: the `s` minimising the layer's output
    error `tr((W - Ŵ) H (W - Ŵ)ᵀ)`, each candidate rounded to nearest on
    Keras's grid (`grid="keras"`) or int4's rule (`grid="refined"`, where
    inputs silent on the calibration data get the mean magnitude of the
    others: with none, their scale is near 0 and their weights come back on
    a grid hundreds of times coarser)."""
    weights = w_nk.float()
    hessian = hessian.float()
    magnitude = silent_as_typical(mean_abs) if grid == "refined" else mean_abs.float()
    magnitude = torch.where(magnitude < 1e-8, torch.full_like(magnitude, 1e-8), magnitude)
    in_features = weights.shape[1]
    group = in_features if group_size == -1 else group_size
    best_loss = None
    best = torch.ones(in_features)
    for i in range(num_grid_points + 1):
        scales = _normalised_scales(magnitude, i / num_grid_points)
        if grid == "refined":
            reconstructed = _rule_round_trip(weights * scales, group) / scales
        else:
            levels, scale, zero, g_idx = quantize_rtn(
                weights * scales, bits=AWQ_BITS, group_size=group
            )
            reconstructed = dequantize_with_sz_map(levels, scale, zero, g_idx) / scales
        loss = _output_error(weights - reconstructed, hessian)
        if best_loss is None or loss < best_loss:
            best_loss, best = loss, scales
    return best


def _clip_bounds(
    scaled: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """Per (row, group), the clamp `c * max|w|` with the least output error
    of the group's columns (the original AWQ's `auto_clip`)."""
    n, k = scaled.shape
    groups = -(-k // group)
    pad = groups * group - k
    if pad:
        scaled = torch.nn.functional.pad(scaled, (0, pad))
        scales = torch.nn.functional.pad(scales, (0, pad), value=1.0)
        hessian = torch.nn.functional.pad(hessian, (0, pad, 0, pad))
    blocks = scaled.reshape(n, groups, group)
    inverse = (1.0 / scales).reshape(groups, group)
    # each group's block of H, in the scaled weights' units: diag(1/s) H_g diag(1/s)
    h_blocks = torch.stack(
        [hessian[g * group : (g + 1) * group, g * group : (g + 1) * group] for g in range(groups)]
    )
    h_blocks = h_blocks * inverse[:, :, None] * inverse[:, None, :]
    amax = blocks.abs().amax(dim=2)
    best_error = torch.full((n, groups), float("inf"))
    best_bound = amax.clone()
    for ratio in CLIP_RATIOS:
        bound = amax * ratio
        clamped = torch.maximum(torch.minimum(blocks, bound[..., None]), -bound[..., None])
        low, high = clamped.amin(dim=2), clamped.amax(dim=2)
        constant = low == high
        low = torch.where(constant, low - 1, low)
        high = torch.where(constant, high + 1, high)
        step = (high - low) / float(2**AWQ_BITS - 1)
        zero = torch.round(-low / step)
        q = torch.clamp(torch.round(clamped / step[..., None] + zero[..., None]), 0, 15)
        delta = blocks - (q - zero[..., None]) * step[..., None]
        error = torch.einsum("ngi,gij,ngj->ng", delta, h_blocks, delta)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_bound = torch.where(better, bound, best_bound)
    return best_bound


def awq_quantize_output(
    w_nk: torch.Tensor,
    hessian: torch.Tensor,
    mean_abs: torch.Tensor,
    *,
    num_grid_points: int = 20,
    group_size: int = -1,
    clip: bool = True,
    grid: str = "refined",
    samples: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ with the output-error search: `(q, scale, zero, awq_scales, g_idx)`
    as `awq_quantize_matrix` (`samples`: the calibration rows behind
    `hessian`, for the refit: `gptq.refit_grid`).

    `grid="keras"`: the candidates and the result on Keras's grid, each
    group's range clipped by the original AWQ's search (`clip`).
    `grid="refined"`: the candidates rounded by int4's rule, the result on
    `gptq.refined_grid` of the scaled weight, its grid then re-fitted to the
    levels on the output error (`gptq.refit_grid`, in the scaled weight's
    units: `H` divided by `s s^T`); no clipping (the refit chooses each
    group's range). A weight already on a grid keeps it when `s = 1` wins.
    """
    if grid not in GRIDS:
        raise ValueError(f"`grid` must be one of {GRIDS}. Received: {grid!r}")
    weights = w_nk.float()
    in_features = weights.shape[1]
    group = in_features if group_size == -1 else group_size
    scales = awq_search_output(
        weights, hessian, mean_abs, num_grid_points=num_grid_points, group_size=group, grid=grid
    )
    scaled = weights * scales
    if grid == "refined":
        q, scale, zero, g_idx = quantize_rtn(
            scaled, bits=AWQ_BITS, group_size=group, grid="refined"
        )
        scaled_hessian = hessian.float() / scales[:, None] / scales[None, :]
        scale, zero = refit_grid(scaled, q, scale, zero, g_idx, scaled_hessian, samples=samples)
        return q, scale, zero, scales, g_idx
    if clip:
        bound = _clip_bounds(scaled, hessian.float(), scales, group)
        columns = bound[:, torch.arange(in_features) // group]
        scaled = torch.maximum(torch.minimum(scaled, columns), -columns)
    q, scale, zero, g_idx = quantize_rtn(scaled, bits=AWQ_BITS, group_size=group)
    return q, scale, zero, scales, g_idx
