"""int4 scales chosen by minimising the weight reconstruction error.

Pure functions on tensors, drop-in alternatives to the min/max rules of
`quantizers.math` with exactly the same output formats, so that the stored
tensors, the kernels and the dequantization are unchanged:

* `search_grouped_int4(kernel, block_size)` -> `(q, scale, zero)` like
  `grouped_quantize_with_zero_point`: `q` int8 in [-8, 7] `(K, N)`, `scale`
  float32 `(G, N)` (positive) and `zero` int8 in [-8, 7] `(G, N)`, with
  `kernel ≈ (q - zero) * scale` in groups of `block_size` rows.
* `search_per_channel_int4(kernel)` -> `(q, scale)`: `q` int8 in [-8, 7]
  `(K, N)` and `scale` float32 `(N,)` (positive), `kernel ≈ q / scale`
  (Keras's symmetric convention; `abs_max_quantize(kernel, 0, (-8, 7))`
  gives the same `scale` as `(1, N)`).

The search, per group (grouped) or column (per channel), in the spirit of
llama.cpp's `make_qkx2_quants`:

1. Candidate 0 is the min/max rule itself, computed with the very same
   expressions.
2. A grid of `ratios`: the range is shrunk (or widened) by each ratio and the
   scale (and zero point) derived from it as min/max would; each group keeps
   the candidate with the smallest squared error.
3. `refine_steps` alternating least-squares steps: the integers of the best
   candidate give the least-squares scale `sum(x * c) / sum(c * c)` (`c = q -
   zero`, tried with the zero point and its two neighbours), rounded again;
   kept where it lowers the error.
4. `balance` (default on): the fewest values nearest their rounding boundary
   are rounded the other way so that the quantization errors of each column
   (the whole contracting axis, in steps) sum to at most half a step. This
   costs about 0.03% of relative weight error but removes most of the error's
   projection on a constant input: after GELU/ReLU/SiLU the inputs of a layer
   have a nonzero mean, and the per-channel codes [-8, 7] clip one side more
   than the other, so unbalanced errors add up coherently in the output (on
   the benchmark MLP the searched per-channel scales give 12.8% output error
   unbalanced, 11.4% balanced; balancing each group instead of each column
   costs more weight error than it saves for blocks of 32).
5. No group ends worse than min/max in squared error: a group that balancing
   would make worse keeps its unbalanced codes (the other groups of its
   column are balanced instead), and, as a last resort, min/max's.

Errors are measured in units of the min/max step of each group, so that huge
(1e30) and tiny values compare without overflow or underflow. The weighting
is plain (activation-agnostic) MSE. Only finite weights are accepted
(`ValueError` otherwise): a NaN or an infinity has no int4 code, and min/max
would silently store NaN scales. As with min/max, `scale >= epsilon / 15`
(grouped) and `scale <= 7 / epsilon` (per channel), so the values of a group
whose whole range is far below `epsilon` quantize to 0.

Work is vectorised over groups and columns; the Python loops are over the
candidates (`len(ratios) + 4 * refine_steps + 1` passes) and over column
slabs of about `chunk_elements` values, which keep the passes in cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtype_policies.quantizers.math import EPSILON, INT4_RANGE

#: Range ratios tried for groups: 0.50, 0.525, ..., 1.05 (23 candidates).
GROUPED_RATIOS: tuple[float, ...] = tuple(round(0.5 + 0.025 * i, 3) for i in range(23))
#: Range ratios tried for channels, which clip more (long columns hold
#: outliers): 0.20, 0.25, ..., 1.05 (18 candidates).
PER_CHANNEL_RATIOS: tuple[float, ...] = tuple(round(0.2 + 0.05 * i, 2) for i in range(18))
DEFAULT_REFINE_STEPS = 2
DEFAULT_CHUNK_ELEMENTS = 1 << 19

_QMIN, _QMAX = INT4_RANGE
_LEVELS = _QMAX - _QMIN  # 15


def _check(kernel: torch.Tensor, ratios: Sequence[float], refine_steps: int) -> None:
    if kernel.dim() != 2:
        raise ValueError(f"Expected a 2D (rows, columns) kernel. Received shape {kernel.shape}")
    if not kernel.is_floating_point():
        raise ValueError(f"Expected a floating-point kernel. Received {kernel.dtype}")
    if any(not (0.0 < float(r) < float("inf")) for r in ratios):
        raise ValueError(f"ratios must be positive and finite. Received: {ratios}")
    if refine_steps < 0:
        raise ValueError(f"refine_steps must be >= 0. Received: {refine_steps}")
    if kernel.numel() and not bool(torch.isfinite(kernel).all()):
        raise ValueError("Cannot quantize a kernel holding NaN or infinite values.")


class _Slab:
    """The groups `(G, B, n)` of a column slab and a work buffer.

    A group's parameter `p` is its step (`inverse=False`, codes `round(x / p)`,
    grouped) or its inverse step (`inverse=True`, codes `round(x * p)`, per
    channel), each the expression of its min/max rule. Codes are `q - zero`,
    clamped to `[-8 - zero, 7 - zero]` (an exact small integer sum). Errors are
    in units of the min/max step `reference`; a candidate costs five in-place
    passes over the slab and no allocation of its size.
    """

    def __init__(self, blocks: torch.Tensor, reference: torch.Tensor, inverse: bool) -> None:
        self.blocks = blocks
        self.reference = reference
        self.inverse = inverse
        if inverse:
            self.normalised = blocks * reference[:, None]
        else:
            self.normalised = blocks / reference[:, None]
        self.work = torch.empty_like(blocks)

    def exact(self, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The values in steps of `p` (unrounded)."""
        if self.inverse:
            return torch.mul(self.blocks, p[:, None], out=out)
        return torch.div(self.blocks, p[:, None], out=out)

    def codes(self, p: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """`q - zero` in the work buffer."""
        codes = self.exact(p, self.work).round_()
        return codes.clamp_(_QMIN - zero[:, None], _QMAX - zero[:, None])

    def step_ratio(self, p: torch.Tensor) -> torch.Tensor:
        """The step of `p` in units of the reference step, `(G, 1, n)`."""
        return (self.reference / p if self.inverse else p / self.reference)[:, None]

    def error_of_codes(self, codes: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Per-group squared error of `codes` (overwritten) with parameter `p`."""
        residual = torch.addcmul(self.normalised, codes, self.step_ratio(p), value=-1.0, out=codes)
        return residual.square_().sum(dim=1)

    def error(self, p: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return self.error_of_codes(self.codes(p, zero), p)

    def least_squares(self, p: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The parameter minimising the error for the codes of `(p, zero)`
        (`p` kept where the fit is undefined or not positive)."""
        codes = self.codes(p, zero)
        denominator = (codes * codes).sum(dim=1)
        numerator = codes.mul_(self.normalised).sum(dim=1)
        if self.inverse:
            fitted = self.reference * denominator / numerator.clamp(min=1e-30)
        else:
            fitted = self.reference * numerator / denominator.clamp(min=1.0)
        usable = (denominator > 0) & (numerator > 0) & torch.isfinite(fitted) & (fitted > 0)
        return torch.where(usable, fitted, p)

    def balanced_codes(
        self, p: torch.Tensor, zero: torch.Tensor, frozen: torch.Tensor
    ) -> torch.Tensor:
        """The codes of `(p, zero)` with the fewest values, those nearest their
        rounding boundary, rounded the other way so that each column's errors
        (in steps, over all its groups) sum to within half a step; no code of a
        `frozen` `(G, n)` group moves. A new tensor."""
        exact = self.exact(p, torch.empty_like(self.blocks))
        codes = self.codes(p, zero).clone()
        error = exact.neg_().add_(codes)  # codes - exact, in steps
        excess = torch.round(error.sum(dim=(0, 1), keepdim=True))  # > 0: lower that many
        count = min(int(excess.abs().max()), codes.shape[0] * codes.shape[1])
        if count == 0:
            return codes
        # Lowering a code changes its squared error by 1 - 2 * error, raising it
        # by 1 + 2 * error: the cheapest moves have the largest key.
        lower = excess > 0
        key = torch.where(lower, error, error.neg())
        low, high = (_QMIN - zero)[:, None], (_QMAX - zero)[:, None]
        movable = torch.where(lower, codes > low, codes < high) & ~frozen[:, None]
        key = key.masked_fill_(~movable, float("-inf")).flatten(0, 1)
        values, indices = key.topk(count, dim=0)
        rank = torch.arange(count, device=codes.device)[:, None]
        chosen = (rank < excess.abs()[0]) & (values > float("-inf"))
        shift = chosen.to(codes.dtype) * -torch.sign(excess[0])
        codes.view(-1, codes.shape[2]).scatter_add_(0, indices, shift)
        return codes


def _search_slab(
    slab: _Slab,
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    refine_steps: int,
    refine_zero: bool,
    balance: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, p, zero)` for a slab, `candidates[0]` being min/max's."""
    minmax_p, minmax_zero = candidates[0]
    minmax_error = slab.error(minmax_p, minmax_zero)
    error, p, zero = minmax_error, minmax_p, minmax_zero

    def offer(candidate_p: torch.Tensor, candidate_zero: torch.Tensor) -> None:
        nonlocal error, p, zero
        candidate_error = slab.error(candidate_p, candidate_zero)
        better = candidate_error < error  # ties keep the earlier candidate
        error = torch.where(better, candidate_error, error)
        p = torch.where(better, candidate_p, p)
        zero = torch.where(better, candidate_zero, zero)

    for candidate in candidates[1:]:
        offer(*candidate)
    for _ in range(refine_steps):
        current_p, current_zero = p, zero
        for shift in (0.0, -1.0, 1.0) if refine_zero else (0.0,):
            shifted = (current_zero + shift).clamp_(_QMIN, _QMAX)
            offer(slab.least_squares(current_p, shifted), shifted)
    if balance:
        # A group that balancing would make worse than min/max keeps its codes
        # (the other groups of its column balance it), a few rounds at most.
        frozen = torch.zeros_like(error, dtype=torch.bool)
        for _ in range(3):
            codes = slab.balanced_codes(p, zero, frozen)
            final_error = slab.error_of_codes(codes.clone(), p)
            worse = final_error > minmax_error
            if not bool(worse.any()):
                break
            frozen |= worse
    else:
        codes = slab.codes(p, zero).clone()
        final_error = error
    worse = (final_error > minmax_error)[:, None]  # only when balancing, rarely
    if bool(worse.any()):
        codes = torch.where(worse, slab.codes(minmax_p, minmax_zero), codes)
        p = torch.where(worse[:, 0], minmax_p, p)
        zero = torch.where(worse[:, 0], minmax_zero, zero)
    return codes.add_(zero[:, None]), p, zero


def _slabs(columns: int, values_per_column: int, chunk_elements: int) -> list[slice]:
    width = max(1, chunk_elements // max(1, values_per_column))
    return [slice(start, start + width) for start in range(0, columns, width)]


def search_grouped_int4(
    kernel: torch.Tensor,
    block_size: int,
    *,
    ratios: Sequence[float] = GROUPED_RATIOS,
    refine_steps: int = DEFAULT_REFINE_STEPS,
    balance: bool = True,
    epsilon: float = EPSILON,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4 of a `(rows, columns)` kernel with searched
    scales and zero points (same format as `grouped_quantize_with_zero_point`).

    Args:
        kernel: Float `(K, N)`, the contracting axis first.
        block_size: Rows per group; rows are zero-padded to a multiple of it
            for the statistics (padding is quantized exactly, error 0).
        ratios: Range ratios tried after min/max (`()` for none).
        refine_steps: Alternating least-squares steps after the grid.
        balance: Re-round so that each group's errors sum to within half a step.
        epsilon: As in min/max: `scale >= epsilon / 15`.
        chunk_elements: Work in column slabs of about this many values.

    Returns:
        `(q, scale, zero)`: `q` int8 `(K, N)` in [-8, 7], `scale` float32
        `(G, N)`, `zero` int8 `(G, N)` in [-8, 7]; `kernel ≈ (q - zero) * scale`
        for the group of each row, with a squared error per group never above
        min/max's.

    >>> import torch
    >>> from dtype_policies.quantizers.math import (
    ...     dequantize_grouped, grouped_quantize_with_zero_point)
    >>> w = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    >>> q, scale, zero = search_grouped_int4(w, 128)
    >>> q.dtype, scale.shape, zero.dtype
    (torch.int8, torch.Size([2, 8]), torch.int8)
    >>> new = (dequantize_grouped(q, scale, zero, 128) - w).norm()
    >>> old = (dequantize_grouped(*grouped_quantize_with_zero_point(w, 128), 128) - w).norm()
    >>> bool(new < old)
    True
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer. Received: {block_size}")
    _check(kernel, ratios, refine_steps)
    rows, columns = kernel.shape
    groups = -(-rows // block_size)
    padded = torch.zeros(groups * block_size, columns, dtype=torch.float32, device=kernel.device)
    padded[:rows] = kernel.float()
    blocks = padded.reshape(groups, block_size, columns)
    q = torch.empty_like(blocks)
    scale = torch.empty(groups, columns, dtype=torch.float32, device=kernel.device)
    zero = torch.empty_like(scale)
    for part in _slabs(columns, groups * block_size, chunk_elements):
        slab_blocks = blocks[:, :, part].contiguous()
        minimum = slab_blocks.amin(dim=1).clamp(max=0.0)
        maximum = slab_blocks.amax(dim=1).clamp(min=0.0)
        # Candidate 0: min/max, exactly as `grouped_quantize_with_zero_point`.
        minmax = (maximum - minimum + epsilon) / _LEVELS
        if not bool(torch.isfinite(minmax).all()):  # a range above float32's max
            minmax = maximum / _LEVELS - minimum / _LEVELS + epsilon / _LEVELS
        candidates = [(minmax, torch.clamp(torch.round(-minimum / minmax) + _QMIN, _QMIN, _QMAX))]
        for ratio in ratios:
            low = minimum * ratio
            step = (maximum * ratio - low) / _LEVELS + epsilon / _LEVELS
            candidates.append((step, torch.clamp(torch.round(-low / step) + _QMIN, _QMIN, _QMAX)))
        slab = _Slab(slab_blocks, minmax, inverse=False)
        q[:, :, part], scale[:, part], zero[:, part] = _search_slab(
            slab, candidates, refine_steps, refine_zero=True, balance=balance
        )
    q = q.reshape(groups * block_size, columns)[:rows]
    return q.to(torch.int8), scale, zero.to(torch.int8)


def search_per_channel_int4(
    kernel: torch.Tensor,
    *,
    ratios: Sequence[float] = PER_CHANNEL_RATIOS,
    refine_steps: int = DEFAULT_REFINE_STEPS,
    balance: bool = True,
    epsilon: float = EPSILON,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int4 (Keras's `x ≈ q / scale`) of a `(K, N)`
    kernel, one scale per column, with searched scales.

    Unlike abs-max (`scale = 7 / max|x|`, codes [-7, 7]) the search also uses
    the code -8: the candidates cover `[min, max]` with `[-8, 7]` steps,
    shrunk by each of `ratios`, then refined by least squares. Arguments as
    for `search_grouped_int4` (`balance` matters most here: see the module).

    Returns:
        `(q, scale)`: `q` int8 `(K, N)` in [-8, 7], `scale` float32 `(N,)`,
        positive, with a squared error per column never above abs-max's.

    >>> import torch
    >>> w = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    >>> q, scale = search_per_channel_int4(w)
    >>> q.dtype, scale.shape, int(q.min()) >= -8 and int(q.max()) <= 7
    (torch.int8, torch.Size([3]), True)
    """
    _check(kernel, ratios, refine_steps)
    rows, columns = kernel.shape
    x = kernel.float().reshape(1, rows, columns)
    q = torch.empty_like(x)
    scale = torch.empty(1, columns, dtype=torch.float32, device=kernel.device)
    for part in _slabs(columns, rows, chunk_elements):
        slab_x = x[:, :, part].contiguous()
        # Candidate 0: abs-max, exactly as `abs_max_quantize(kernel, 0, (-8, 7))`.
        absmax = _QMAX / (slab_x.abs().amax(dim=1) + epsilon)
        zeros = torch.zeros_like(absmax)
        # The step covering [min, max] with the codes [-8, 7].
        cover = torch.maximum(
            slab_x.amax(dim=1).clamp(min=0.0) / _QMAX, slab_x.amin(dim=1).clamp(max=0.0) / _QMIN
        )
        candidates = [(absmax, zeros)]
        candidates += [(1.0 / (cover * ratio + epsilon / _QMAX), zeros) for ratio in ratios]
        slab = _Slab(slab_x, absmax, inverse=True)
        q[:, :, part], scale[:, part], _ = _search_slab(
            slab, candidates, refine_steps, refine_zero=False, balance=balance
        )
    return q.reshape(rows, columns).to(torch.int8), scale.reshape(-1)
