"""GPTQ's quantization math (pure functions on tensors): Keras's grid
(`compute_quantization_parameters`, unsigned levels `0..2**bits - 1` with a
zero point) and this library's (`refined_grid`, chosen once from the float
weights; `refit_grid`, re-fitted to the levels on the output error), the
column loops (`gptq_quantize_matrix` on Keras's grids, op for op;
`gptq_quantize_on_grid` on fixed ones), and the whole per-weight algorithm
(`gptq_quantize`).

The column loop quantizes an (N, K) weight one input column at a time and
compensates each column's rounding error on the columns not yet quantized,
`W[:, j+1:] -= (w_j - q_j) / M[j, j] * M[j, j+1:]`, applying the updates
lazily in blocks of 128 columns. What `M` is decides the algorithm:

* the reference GPTQ (Frantar et al.; IST-DASLab's code) feeds the upper
  Cholesky factor of the inverse of the damped Hessian: row `j` of that
  factor is exactly the inverse Hessian of the columns `j..K-1` (the columns
  before `j` already removed), scaled, so each update is the optimal one
  (Optimal Brain Surgeon) for the columns that remain. `gptq_quantize` does
  this (`inverse="cholesky"`, the default).
* Keras 3.15 feeds the plain inverse of the damped Hessian
  (`linalg.inv`): its rows do not account for the columns already
  quantized, so later updates use the wrong conditional inverse.
  `gptq_quantize(..., inverse="keras")` reproduces Keras's integers exactly
  (tested against Keras itself).

>>> import torch
>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> w = torch.randn(8, 32)
>>> x = torch.randn(256, 32)
>>> q, scale, zero, g_idx = gptq_quantize(w, 2 * x.T @ x / 256, bits=4, group_size=16)
>>> q.shape, scale.shape, g_idx.tolist()[14:18]
(torch.Size([8, 32]), torch.Size([8, 2]), [0, 0, 1, 1])
>>> deq = dequantize_with_sz_map(q, scale, zero, g_idx)
>>> rtn = dequantize_with_sz_map(*quantize_rtn(w, bits=4, group_size=16))
>>> bool(((x @ (w - deq).T) ** 2).sum() < ((x @ (w - rtn).T) ** 2).sum())
True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtype_policies._cpu import single_threaded
from dtype_policies.quantizers.math import grouped_quantize_with_zero_point
from dtype_policies.quantizers.zero_points import refine_zero_points

GridFunction = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, float]]

INVERSES = ("cholesky", "keras")
GRIDS = ("refined", "keras")


def compute_quantization_parameters(
    x: torch.Tensor,
    *,
    bits: int,
    symmetric: bool = False,
    per_channel: bool = False,
    group_size: int = -1,
    round_zero: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Keras's `compute_quantization_parameters` for an (N, K) tensor:
    `(scale, zero, maxq)` with `scale`, `zero` of shape (N, groups) (per
    tensor: one value repeated over N) and levels `0..maxq`, so that
    `x ~= scale * (q - zero)`. The range is each row's (group's) min..max
    (zero is not forced into it); a constant row gets min - 1..max + 1.

    The zero point is float32: Keras casts it to uint8, which wraps a
    negative zero point (a group whose values are all positive) into
    nonsense; here it stays the real value `round(-min / scale)` (or
    `-min / scale` with `round_zero=False`, which puts min and max exactly on
    the grid).
    """
    if x.dim() < 2:
        raise ValueError(f"Input weight tensor must have a rank of at least 2, got {x.dim()}.")
    if x.numel() == 0:
        raise ValueError("Input tensor 'x' cannot be empty.")
    x = x.float()
    out_features, in_features = x.shape[0], x.shape[1]
    groups = -(-in_features // group_size) if per_channel and group_size > 0 else 1
    if groups > 1:
        pad = groups * group_size - in_features
        padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
        grouped = padded.reshape(out_features, groups, group_size)
        low, high = grouped.amin(dim=2), grouped.amax(dim=2)
    else:
        rows = x.reshape(out_features, -1) if per_channel else x.reshape(1, -1)
        low, high = rows.amin(dim=1), rows.amax(dim=1)
    if symmetric:
        max_abs = torch.maximum(low.abs(), high)
        low = torch.where(low < 0, -max_abs, low)
        high = max_abs
    constant = low == high
    low = torch.where(constant, low - 1, low)
    high = torch.where(constant, high + 1, high)
    maxq = float(2**bits - 1)
    scale = (high - low) / torch.tensor(maxq, dtype=torch.float32)
    scale = torch.where(scale <= 0, torch.tensor(1e-8), scale)
    if symmetric:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = -low / scale
        zero = torch.round(zero) if round_zero else zero
    if groups == 1:
        scale, zero = scale.reshape(-1, 1), zero.reshape(-1, 1)
        if not per_channel:
            scale, zero = scale.expand(out_features, 1), zero.expand(out_features, 1)
    return scale, zero, maxq


def keras_grid(
    bits: int, *, symmetric: bool = False, per_channel: bool = True, round_zero: bool = True
) -> GridFunction:
    """The `compute_scale_zero` function of a GPTQ config (Keras's
    `GPTQQuantizer.find_params`), applied to one group's columns."""

    def compute_scale_zero(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        return compute_quantization_parameters(
            x,
            bits=bits,
            symmetric=symmetric,
            per_channel=per_channel,
            group_size=-1,
            round_zero=round_zero,
        )

    return compute_scale_zero


def refined_grid(
    w_nk: torch.Tensor,
    *,
    bits: int,
    group_size: int = -1,
    symmetric: bool = False,
    per_channel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This library's grid of an (N, K) float weight, `(scale, zero, maxq)`
    with `scale`, `zero` (N, groups) in Keras's unsigned convention: int4's
    round-to-nearest rule (`quantizers.math.grouped_quantize_with_zero_point`,
    at `bits` levels: 0 exactly on the grid, unless a group lies on one side
    of it or already on a grid of its own, which is then reproduced exactly),
    the zero points refined as int4's (`quantizers.zero_points`, up to 4
    bits). Symmetric or per-tensor grids are Keras's, of the same weights.

    GPTQ fixes these grids before its column loop (`grid="refined"`): a
    weight already on a grid (SmolLM2's GGUF was Q4_1 blocks of 32) keeps it,
    and with activation order the groups stay the natural ones, so the
    kernels need no permutation.
    """
    block = w_nk.shape[1] if group_size == -1 else group_size
    if symmetric or not per_channel:  # Keras's grid of each group's columns
        parts = [
            compute_quantization_parameters(
                w_nk[:, start : start + block],
                bits=bits,
                symmetric=symmetric,
                per_channel=per_channel,
            )
            for start in range(0, w_nk.shape[1], block)
        ]
        scale = torch.cat([part[0] for part in parts], dim=1)
        return scale, torch.cat([part[1] for part in parts], dim=1), parts[0][2]
    offset = 2 ** (bits - 1)
    value_range = (-offset, offset - 1)
    kernel = w_nk.float().t()
    q, scale, zero = grouped_quantize_with_zero_point(kernel, block, value_range=value_range)
    if bits <= 4:
        q, zero = refine_zero_points(kernel, q, scale, zero, block, value_range=value_range)
    return scale.t().contiguous(), (zero + offset).t().contiguous(), float(2**bits - 1)


def quantize_with_zero_point(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: float
) -> torch.Tensor:
    """`clip(round(x / scale + zero), 0, maxq)` (float; Keras's op order)."""
    safe = torch.where(scale == 0, torch.tensor(1e-8, dtype=scale.dtype), scale)
    return torch.clamp(torch.round(x / safe + zero.to(scale.dtype)), 0, maxq)


def dequantize_with_zero_point(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """`scale * (q - zero)`."""
    return scale * (q - zero.to(scale.dtype))


def dequantize_with_sz_map(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """The float (N, K) weight of levels `q` with (N, groups) `scale`/`zero`
    and the group of each column `g_idx` (Keras's, with `group_axis=-1`)."""
    groups = g_idx.long()
    return (q.float() - zero[:, groups].float()) * scale[:, groups].float()


def stable_permutation(metric: torch.Tensor) -> torch.Tensor:
    """Keras's `_stable_permutation`: the indices sorting `metric` in
    descending order, ties in index order."""
    n = metric.shape[0]
    jitter = torch.arange(n, dtype=torch.float32) / float(n)
    return torch.argsort(-(metric + jitter * 1e-12), stable=True)


def gptq_quantize_matrix(
    w_nk: torch.Tensor,
    inverse: torch.Tensor,
    *,
    blocksize: int = 128,
    group_size: int = -1,
    activation_order: bool = False,
    order_metric: torch.Tensor | None = None,
    compute_scale_zero: GridFunction | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop (Keras's `gptq_quantize_matrix`, op for op).

    Args:
        w_nk: The (N, K) float weight (`[out_features, in_features]`).
        inverse: The (K, K) matrix whose rows drive the error feedback (see
            the module docstring: the upper Cholesky factor of the inverse
            Hessian, or Keras's plain inverse).
        blocksize: Columns updated eagerly; the rest get one update per block.
        group_size: Columns sharing a scale and zero point (-1: all).
        activation_order: Quantize columns by decreasing `order_metric`
            (default `1 / diag(inverse)`), permuting `w_nk` and `inverse`
            (rows and columns) first.
        compute_scale_zero: `(N, g) columns -> (scale, zero, maxq)` (default:
            4-bit asymmetric per channel).

    Returns:
        `(q, scale, zero, g_idx)`: int32 levels (N, K) in the original column
        order, float32 (N, groups) scales and zero points in the order the
        groups were quantized, and each column's group (int64, (K,)).

    Each group's scale and zero point come from its columns as they are when
    its first column is reached. Keras 3.15 recomputes them at every block
    of `blocksize` columns, appending one more (N, 1) scale each time, so for
    groups wider than a block (and per channel with K > `blocksize`) its
    stored scales no longer match the levels; the two agree everywhere else.
    """
    compute = compute_scale_zero or keras_grid(4)
    in_features = w_nk.shape[1]
    weights = w_nk.float()
    inverse = inverse.float()
    perm = inv_perm = None
    if activation_order:
        if order_metric is None:
            order_metric = 1.0 / (torch.diagonal(inverse) + 1e-12)
        else:
            order_metric = order_metric.float()
            order_metric = torch.where(
                torch.isfinite(order_metric), order_metric, torch.zeros_like(order_metric)
            )
        perm = stable_permutation(order_metric)
        inv_perm = torch.argsort(perm, stable=True)
        weights = weights[:, perm]
        inverse = inverse[perm][:, perm]
    else:
        weights = weights.clone()
    levels = torch.zeros(weights.shape, dtype=torch.int32)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    group = in_features if group_size == -1 else group_size
    cached = -1  # each group's parameters are computed once, at its first column
    for start in range(0, in_features, blocksize):
        end = min(start + blocksize, in_features)
        with single_threaded():
            block = weights[:, start:end].clone()
            block_levels = torch.empty_like(block)
            block_error = torch.empty_like(block)
            block_inverse = inverse[start:end, start:end]
            for j in range(end - start):
                column = start + j
                group_start = (column // group) * group
                if group_start != cached:
                    group_end = min(group_start + group, in_features)
                    scale, zero, maxq = compute(weights[:, group_start:group_end])
                    scales.append(scale)
                    zeros.append(zero)
                    cached = group_start
                    step = torch.where(scale == 0, torch.tensor(1e-8), scale)[:, 0]
                    offset = zero[:, 0].to(scale.dtype)
                    step_zero = scale[:, 0]
                # Keras's quantize_with_zero_point and dequantize_with_zero_point, op for op
                w = block[:, j]
                q = torch.clamp(torch.round(w / step + offset), 0, maxq)
                block_levels[:, j] = q
                error = (w - step_zero * (q - offset)) / block_inverse[j, j]
                block_error[:, j] = error
                if j < end - start - 1:
                    block[:, j + 1 :] -= error[:, None] * block_inverse[j, j + 1 :][None, :]
            levels[:, start:end] = block_levels.to(torch.int32)
        if end < in_features:
            weights[:, end:] -= torch.matmul(block_error, inverse[start:end, end:])
    g_idx = torch.arange(in_features) // group
    if perm is not None:
        g_idx = g_idx[inv_perm]
        levels = levels[:, inv_perm]
    return levels, torch.cat(scales, dim=1), torch.cat(zeros, dim=1), g_idx


def damped_hessian(hessian: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(H + damping * mean(diag H) * I, dead)`: Keras's and the reference's
    damping, after giving input features that never fired (`diag == 0`) a
    diagonal of 1; `dead` marks them."""
    hessian = hessian.float()
    diagonal = torch.diagonal(hessian)
    dead = diagonal == 0
    fixed = torch.where(dead, torch.ones_like(diagonal), diagonal)
    damped = hessian.clone()
    damped.diagonal().copy_(fixed + damping * fixed.mean())
    return damped, dead


def _upper_cholesky_of_inverse(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """The upper Cholesky factor of the inverse of the damped Hessian (float32
    as the reference; then float64, damping ten times more each time, until
    the Hessian is positive definite)."""
    mean = torch.diagonal(hessian).double().mean()
    extra = 0.0
    with single_threaded():
        for attempt_dtype in (torch.float32, *([torch.float64] * 7)):
            attempt = hessian.to(attempt_dtype)
            attempt.diagonal().add_(extra * mean)
            lower, info = torch.linalg.cholesky_ex(attempt)
            if int(info) == 0:
                inverse = torch.cholesky_inverse(lower)
                upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
                if int(info) == 0 and torch.isfinite(upper).all():
                    return upper.float()
            extra = max(extra * 10, damping, 1e-6)
    raise ValueError(
        "GPTQ: the Hessian of the layer's inputs is not positive definite even after damping "
        "(non-finite calibration activations?)."
    )


def gptq_quantize_on_grid(
    w_nk: torch.Tensor,
    upper: torch.Tensor,
    column_scale: torch.Tensor,
    column_zero: torch.Tensor,
    maxq: float,
    *,
    blocksize: int = 128,
) -> torch.Tensor:
    """GPTQ's column loop on grids fixed beforehand: the (N, K) int32 levels
    of `w_nk`, column `j` rounded to `column_scale[:, j] * (q - column_zero[:, j])`,
    `q` in `0..maxq`, its error compensated on the later columns through the
    rows of `upper` (the upper Cholesky factor of the inverse Hessian, in the
    columns' order) as in `gptq_quantize_matrix`."""
    in_features = w_nk.shape[1]
    # transposed, so that each column is a contiguous row: 1.5-2x faster loops
    weights = w_nk.float().t().contiguous()
    inverse_step = (1.0 / column_scale.float().clamp(min=1e-12)).t().contiguous()
    steps = column_scale.float().t().contiguous()
    offsets = column_zero.float().t().contiguous()
    levels = torch.empty(weights.shape, dtype=torch.int32)
    with single_threaded():
        for start in range(0, in_features, blocksize):
            end = min(start + blocksize, in_features)
            block = weights[start:end].clone()
            block_error = torch.empty_like(block)
            block_inverse = upper[start:end, start:end]
            for j in range(end - start):
                column = start + j
                w = block[j]
                q = torch.clamp(torch.round(w * inverse_step[column] + offsets[column]), 0, maxq)
                levels[column] = q.to(torch.int32)
                error = (w - steps[column] * (q - offsets[column])) / block_inverse[j, j]
                block_error[j] = error
                if j < end - start - 1:
                    block[j + 1 :].addr_(block_inverse[j, j + 1 :], error, alpha=-1)
            if end < in_features:
                weights[end:] -= upper[start:end, end:].t() @ block_error
    return levels.t().contiguous()


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Per row of an (N, K) weight error `D`, `(D H Dᵀ)[n, n]`: its share of
    the layer's squared output error on inputs of second moment `H`."""
    return ((delta @ hessian) * delta).sum(dim=1)


def silent_as_typical(values: torch.Tensor) -> torch.Tensor:
    """Per-input statistics (float32) with the inputs silent on the
    calibration data (a zero) given the mean of the others (1 if all are
    silent): an input silent in calibration may not be silent later."""
    values = values.float()
    silent = values == 0
    if not bool(silent.any()):
        return values
    live = values[~silent]
    return torch.where(silent, live.mean() if live.numel() else values.new_tensor(1.0), values)


def _silent_inputs_as_typical(hessian: torch.Tensor) -> torch.Tensor:
    """`H` (float32) with its silent diagonal entries made typical (`silent_as_typical`)."""
    hessian = hessian.float()
    diagonal = torch.diagonal(hessian)
    if not bool((diagonal == 0).any()):
        return hessian
    hessian = hessian.clone()
    hessian.diagonal().copy_(silent_as_typical(diagonal))
    return hessian


REFIT_DAMPING = 0.01
"""The damping of `refit_grid`'s objective when the caller gives none (AWQ):
Keras's default `hessian_damping`, GPTQ's."""


def refit_grid(
    w_nk: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    g_idx: torch.Tensor,
    hessian: torch.Tensor,
    damping: float = REFIT_DAMPING,
    samples: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Given the levels `q` (N, K), the (N, G) `scale` and `zero` that
    minimise each row's output error `output_error(W - scale * (q - zero))`
    on the Hessian `H` of the inputs: per row a least-squares problem in its
    2G values (a step and an offset per group), solved exactly. A row keeps
    its grid when the solution is not better (or not a valid grid: a step
    that is not positive), so no row's error rises.

    GPTQ chooses the levels column by column with the grid fixed; this
    chooses the grid given the levels. Measured on SmolLM2-135M, gptq/4/128
    with activation order on 32 x 512 tokens: layer output errors -12%,
    perplexity 28.5 -> 27.5 (float32 24.92).

    Inputs silent on the calibration data (`H[k, k] == 0`) count as typical
    ones (the mean diagonal), so that the new grid does not move their
    weights, unseen by `H`, by whole steps: an input silent in calibration
    may not be silent later.

    The error is measured on `H` shrunk towards `mean(diag H) * I` by the
    number of calibration rows `samples` behind it (weight `K / (samples +
    K)`, a covariance estimate's shrinkage), or by `damping` when the rows
    are not given: from few rows (a rarely routed expert) `H` is singular,
    and the plain fit moves the weights freely along the directions those
    rows never saw (a linear with 256 inputs calibrated on 12 rows: held-out
    error 6-9x round to nearest's; shrunk: below round to nearest's). Not
    both: the damping added to the shrinkage weighed the inputs quiet in
    calibration up on a dense model (SmolLM2 gptq/4/128 28.54 against 27.95
    shrunk alone: docs/quantization.md).
    """
    weights, levels, hessian = w_nk.float(), q.float(), _silent_inputs_as_typical(hessian)
    features = hessian.shape[0]
    typical = torch.diagonal(hessian).mean()
    # the rows' shrinkage where their number is known, else the damping
    shrink = damping if samples is None else features / (max(samples, 0) + features)
    if shrink > 0:
        identity = torch.eye(features, dtype=hessian.dtype, device=hessian.device)
        hessian = (1 - shrink) * hessian + shrink * typical * identity
    n, groups = weights.shape[0], scale.shape[1]
    member = torch.nn.functional.one_hot(g_idx.long(), groups).float()  # (K, G)
    weighted = weights @ hessian  # rows of W H
    hessian_members = hessian @ member  # (K, G)
    # rows' normal equations A θ = b, θ = (steps of the G groups, offsets of the G groups)
    system = torch.empty(n, 2 * groups, 2 * groups)
    for g in range(groups):
        columns = member[:, g] > 0
        levels_times_h = levels[:, columns] @ hessian[columns]  # (N, K): Σ_{l in g} q_l H_lk
        system[:, :groups, g] = (levels * levels_times_h) @ member
        system[:, groups:, g] = levels_times_h @ member
    system[:, :groups, groups:] = system[:, groups:, :groups].transpose(1, 2)
    system[:, groups:, groups:] = member.t() @ hessian_members
    right = torch.cat([(levels * weighted) @ member, weighted @ member], dim=1)
    ridge = 1e-6 * torch.diagonal(system, dim1=1, dim2=2).mean(dim=1).clamp(min=1e-12)
    system.diagonal(dim1=1, dim2=2).add_(ridge[:, None])
    solution, info = torch.linalg.solve_ex(system, right.unsqueeze(-1))
    solution = solution.squeeze(-1)
    steps, offsets = solution[:, :groups], solution[:, groups:]
    valid = (info == 0) & (steps > 0).all(dim=1) & torch.isfinite(solution).all(dim=1)
    safe_steps = torch.where(steps > 0, steps, torch.ones_like(steps))
    zeros = -offsets / safe_steps
    columns = g_idx.long()
    before = output_error(weights - (levels - zero[:, columns]) * scale[:, columns], hessian)
    after = output_error(weights - (levels - zeros[:, columns]) * safe_steps[:, columns], hessian)
    better = (valid & (after < before))[:, None]
    return torch.where(better, safe_steps, scale.float()), torch.where(better, zeros, zero.float())


def gptq_quantize(
    w_nk: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    per_channel: bool = True,
    damping: float = 0.01,
    activation_order: bool = False,
    blocksize: int = 128,
    inverse: str = "cholesky",
    round_zero: bool = True,
    grid: str = "refined",
    samples: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of one (N, K) weight given the (K, K) Hessian of its inputs
    (`2 XᵀX / n`): `(q, scale, zero, g_idx)` as `gptq_quantize_matrix`.

    `inverse="cholesky"` is the reference algorithm: input features that
    never fired get zero weight, the columns are ordered by decreasing
    Hessian diagonal (with `activation_order`), and the loop is fed the upper
    Cholesky factor of the damped, permuted Hessian's inverse.
    `inverse="keras"` is Keras 3.15's `GPTQ.quantize_and_correct_layer`: the
    loop is fed `inverse(damped Hessian)` and orders the columns by the
    damped diagonal.

    `grid="refined"` (with the reference inverse) fixes every group's grid
    before the loop, from the float weights (`refined_grid`), keeps the
    natural groups under activation order (`g_idx = arange(K) // group_size`)
    and rounds the weights of inputs that never fired to nearest (the
    reference zeroes them: an input silent on the calibration data may not
    be silent later); after the loop each row's grid is re-fitted to its
    levels (`refit_grid`, told of the `samples` calibration rows behind
    `hessian` when given);
    `grid="keras"` computes each group's grid, Keras's min/max with a rounded
    zero point, from its columns as they are when the loop reaches them
    (already moved by the compensation of earlier columns), and `g_idx`
    follows the activation order. Measured on SmolLM2-135M (its GGUF
    weights are Q4_1 blocks of 32), 32 x 512 calibration tokens, float32,
    perplexity (float32 24.92): gptq/4/32 28.0 on Keras's grids, 24.9 on
    refined ones; gptq/4/128 30.1 on Keras's grids, 29.3 on refined grids,
    28.5 with activation order too, 27.5 with the refit.
    """
    if inverse not in INVERSES:
        raise ValueError(f"`inverse` must be one of {INVERSES}. Received: {inverse!r}")
    if grid not in GRIDS:
        raise ValueError(f"`grid` must be one of {GRIDS}. Received: {grid!r}")
    if grid == "refined" and inverse == "keras":
        raise ValueError(
            "`grid='refined'` needs the reference inverse (`inverse='cholesky'`); Keras's "
            "integers come from `grid='keras', inverse='keras'`."
        )
    damped, dead = damped_hessian(hessian, damping)
    if inverse == "keras":
        return gptq_quantize_matrix(
            w_nk,
            torch.linalg.inv(damped),
            blocksize=blocksize,
            group_size=group_size,
            activation_order=activation_order,
            order_metric=torch.diagonal(damped),
            compute_scale_zero=keras_grid(
                bits, symmetric=symmetric, per_channel=per_channel, round_zero=round_zero
            ),
        )
    in_features = w_nk.shape[1]
    weights = w_nk.float().clone()
    perm = stable_permutation(torch.diagonal(damped)) if activation_order else None
    inv_perm = None if perm is None else torch.argsort(perm, stable=True)
    if grid == "refined":
        scale, zero, maxq = refined_grid(
            weights, bits=bits, group_size=group_size, symmetric=symmetric, per_channel=per_channel
        )
        g_idx = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
        column_scale, column_zero = scale[:, g_idx], zero[:, g_idx]
        if perm is not None:
            weights, damped = weights[:, perm], damped[perm][:, perm]
            column_scale, column_zero = column_scale[:, perm], column_zero[:, perm]
        upper = _upper_cholesky_of_inverse(damped, damping)
        q = gptq_quantize_on_grid(
            weights, upper, column_scale, column_zero, maxq, blocksize=blocksize
        )
        if inv_perm is not None:
            q = q[:, inv_perm]
        if not symmetric and per_channel:
            scale, zero = refit_grid(w_nk, q, scale, zero, g_idx, hessian, damping, samples)
        return q, scale, zero, g_idx
    weights[:, dead] = 0
    if perm is not None:
        weights, damped = weights[:, perm], damped[perm][:, perm]
    upper = _upper_cholesky_of_inverse(damped, damping)
    compute = keras_grid(bits, symmetric=symmetric, per_channel=per_channel, round_zero=round_zero)
    q, scale, zero, g_idx = gptq_quantize_matrix(
        weights, upper, blocksize=blocksize, group_size=group_size, compute_scale_zero=compute
    )
    if inv_perm is not None:
        q, g_idx = q[:, inv_perm], g_idx[inv_perm]
    assert g_idx.shape == (in_features,)
    return q, scale, zero, g_idx


def quantize_rtn(
    w_nk: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    per_channel: bool = True,
    round_zero: bool = True,
    grid: str = "keras",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest on GPTQ's grid (no error compensation; what GPTQ
    gives with an identity Hessian): `(q, scale, zero, g_idx)`; Keras's grid
    (`grid="keras"`, `round_zero` as `compute_quantization_parameters`) or
    this library's (`"refined"`, `refined_grid`)."""
    if grid not in GRIDS:
        raise ValueError(f"`grid` must be one of {GRIDS}. Received: {grid!r}")
    in_features = w_nk.shape[1]
    group = in_features if group_size == -1 else group_size
    g_idx = torch.arange(in_features) // group
    if grid == "refined":
        scale, zero, maxq = refined_grid(
            w_nk, bits=bits, group_size=group_size, symmetric=symmetric, per_channel=per_channel
        )
        levels = quantize_with_zero_point(w_nk.float(), scale[:, g_idx], zero[:, g_idx], maxq)
        return levels.to(torch.int32), scale, zero, g_idx
    compute = keras_grid(bits, symmetric=symmetric, per_channel=per_channel, round_zero=round_zero)
    scales, zeros, levels_list = [], [], []
    for start in range(0, in_features, group):
        columns = w_nk[:, start : start + group].float()
        scale, zero, maxq = compute(columns)
        levels_list.append(quantize_with_zero_point(columns, scale, zero, maxq).to(torch.int32))
        scales.append(scale)
        zeros.append(zero)
    return torch.cat(levels_list, dim=1), torch.cat(scales, dim=1), torch.cat(zeros, dim=1), g_idx
