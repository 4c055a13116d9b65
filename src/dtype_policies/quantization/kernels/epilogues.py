"""Element-wise passes around the quantized products (per-row and per-block
activation quantization, rescaling), optionally fused with `torch.compile`.

Fusion is opt-in (`set_compile_epilogues(True)` or the environment variable
`DTYPE_POLICIES_COMPILE=1`): compiling costs seconds on the first call and
about a second per new input shape, which eager inference should never pay.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._core.casting import bfloat16_rounded, bias_in, tracing
from dtype_policies.quantizers.math import EPSILON, block_abs_max

_compile_enabled = os.environ.get("DTYPE_POLICIES_COMPILE", "0") == "1"
_compiled: dict[Callable, Callable] = {}


def set_compile_epilogues(enabled: bool) -> None:
    """Turns the `torch.compile` fusion of quantize/rescale passes on or off.

    >>> from dtype_policies.quantization import set_compile_epilogues
    >>> set_compile_epilogues(False)
    """
    global _compile_enabled
    _compile_enabled = bool(enabled)


def compile_epilogues_enabled() -> bool:
    """Whether the quantize/rescale passes are fused with `torch.compile`.

    Off unless `DTYPE_POLICIES_COMPILE=1` or `set_compile_epilogues(True)`.

    >>> from dtype_policies.quantization import compile_epilogues_enabled, set_compile_epilogues
    >>> set_compile_epilogues(True)
    >>> compile_epilogues_enabled()
    True
    >>> set_compile_epilogues(False)
    """
    return _compile_enabled


def run(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, through its compiled form when fusion is on (falling back
    to eager, after one warning, if compilation fails)."""
    global _compile_enabled
    if not _compile_enabled or tracing():
        return fn(*args)
    compiled = _compiled.get(fn)
    if compiled is None:
        compiled = _compiled[fn] = torch.compile(fn, dynamic=None)
    try:
        return compiled(*args)
    except Exception as e:  # a compiler problem must never break a forward
        _compile_enabled = False
        warnings.warn(
            f"dtype_policies: torch.compile of the quantization epilogues failed ({e!r}); "
            "continuing with eager kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(*args)


def row_steps(x: torch.Tensor) -> torch.Tensor:
    """Per-row quantization steps `(max|x| + eps) / 127`, (M, 1) float32."""
    # abs().amax() rather than vector_norm(x, inf): the same values, and 10-20x
    # faster on CPU for more than one row (torch 2.13, measured).
    absmax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    return absmax.add_(EPSILON).div_(127.0)


def _row_quotients(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`round(x / step)`, float32, in [-127, 127]: `|x / step| <= 127` by
    construction for a finite row. A row holding NaN or inf has a NaN or inf
    step, so its quotients are 0 or NaN; NaN becomes 0 (a NaN cast to an integer
    is undefined: 0 eager, -128 compiled) and the row's non-finite step alone
    carries the row to NaN (`0 * NaN`, `0 * inf`)."""
    return torch.div(x, step).round_().nan_to_num_(nan=0.0)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: `(q, step)` with `x ~= q * step`, `step` (M, 1)
    float32 (see `_row_quotients` for rows that are not finite)."""
    step = row_steps(x)
    return _row_quotients(x, step).to(torch.int8), step


def quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_int8` shifted to uint8 with zero point 128."""
    step = row_steps(x)
    return _row_quotients(x, step).add_(128.0).to(torch.uint8), step


def quantize_rows_split_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_int8` split by sign: `(u, step)` with `u` (2M, K) uint8,
    the first M rows `max(q, 0)`, the last M rows `max(-q, 0)` (both in
    [0, 127]), so that `q = u[:M] - u[M:]`."""
    step = row_steps(x)
    q = _row_quotients(x, step)
    return torch.cat([q.clamp(min=0), q.neg_().clamp_(min=0)]).to(torch.uint8), step


def rescale(
    y: torch.Tensor,
    row_step: torch.Tensor,
    column_step: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`(y * row_step * column_step + bias)` in `out_dtype`, computed in float32."""
    y = torch.mul(y, row_step)  # a new float32 tensor, then in place
    if column_step is not None:
        y.mul_(column_step)
    if bias is not None:
        y.add_(bias_in(bias, torch.float32) if tracing() else bias)
    return y.to(out_dtype)


def round_activation_blocks(x2: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The float32 values of `x2` (M, K) rounded to bfloat16, then to int8 in
    blocks of `block` consecutive inputs (the last may be shorter): per block
    `d = max|x| / 127` and `round(x / d) * d` (half to even; a block of zeros
    stays zero). llama.cpp's Q8_0 rule, which the W4A8 kernels (int4's, int8's)
    apply.

    >>> import torch
    >>> x = torch.tensor([[127.0, -63.0, 2.0, 0.5]])
    >>> round_activation_blocks(x, block=2)  # 0.5 is 31.75 steps of 2 / 127: 32
    tensor([[127.0000, -63.0000,   2.0000,   0.5039]])
    """
    x = bfloat16_rounded(x2)
    step = block_abs_max(x, block) / 127.0  # each input's block's (Inductor: see there)
    rounded = torch.where(step > 0, torch.round(x / step), torch.zeros_like(x))
    return rounded.clamp(-127, 127) * step
