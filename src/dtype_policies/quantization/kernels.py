"""Quantized matrix products: the fastest correct path for each shape and device.

int8 (W8A8 dynamic, Keras's convention `y = acc / (x_scale * w_scale) + b`):
  * CPU, 16 rows or more: oneDNN's `qlinear_pointwise` on a prepacked weight,
    with activations as uint8 (q + 128, zero point 128), the fastest int8 GEMM
    on x86 (VNNI);
  * CPU, fewer rows: `torch._int_mm` on the (N, K) weight's transposed view;
  * elsewhere: `torch._int_mm` where CUDA accepts the shape, else exact
    integer arithmetic in float32.
  The per-token quantization and the rescale are element-wise passes, fused
  with `torch.compile` when it is available (set `DTYPE_POLICIES_COMPILE=0`
  to run them eagerly).
int8 weight-only: `_weight_int8pack_mm` for bfloat16/float16 activations of a
  few rows on CPU, else the product with the int8 weight cast to the compute
  dtype and the per-channel scale applied to the output.
int4 (weight-only): `_weight_int4pack_mm_for_cpu` for bfloat16 activations on
  CPU (block size 32/64/128/256 dividing K, N a multiple of 16; per-channel
  weights use the largest such block with a repeated scale), else dequantize
  and multiply in the compute dtype.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies.quantization.quantizers import EPSILON, dequantize_grouped

_ONEDNN_MIN_ROWS = 16
_INT4_KERNEL_BLOCKS = (256, 128, 64, 32)
_WEIGHT_INT8PACK_MAX_ROWS = 16

# ---------------------------------------------------------------- element-wise passes


def _quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    inverse = (x.abs().amax(dim=-1, keepdim=True) + EPSILON) / 127.0
    q = torch.clamp(torch.round(x / inverse), -127.0, 127.0)
    return q.to(torch.int8), inverse


def _quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    inverse = (x.abs().amax(dim=-1, keepdim=True) + EPSILON) / 127.0
    q = torch.clamp(torch.round(x / inverse), -127.0, 127.0) + 128.0
    return q.to(torch.uint8), inverse


def _rescale(
    y: torch.Tensor,
    row_scale: torch.Tensor,
    column_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    y = y.float() * row_scale
    if column_scale is not None:
        y = y * column_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


_compile_enabled = os.environ.get("DTYPE_POLICIES_COMPILE", "1") != "0"
_compiled: dict[Callable, Callable] = {}


def _fused(fn: Callable) -> Callable:
    """`fn`, compiled with inductor when enabled and possible, else eager.

    Compilation happens on first use; if it fails (no C++ compiler, ...) the
    eager function is used from then on, after one warning.
    """
    global _compile_enabled
    if not _compile_enabled or torch.compiler.is_compiling():
        return fn
    compiled = _compiled.get(fn)
    if compiled is None:
        compiled = torch.compile(fn, dynamic=None)
        _compiled[fn] = compiled
    return compiled


def _run_fused(fn: Callable, *args: Any) -> Any:
    global _compile_enabled
    try:
        return _fused(fn)(*args)
    except Exception as e:  # a compiler problem must never break a forward
        if not _compile_enabled or fn not in _compiled:
            raise
        _compile_enabled = False
        warnings.warn(
            f"dtype_policies: torch.compile of the quantization epilogues failed ({e!r}); "
            "continuing with eager kernels (slower).",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(*args)


def set_compile_epilogues(enabled: bool) -> None:
    """Turns the `torch.compile` fusion of quantize/rescale passes on or off."""
    global _compile_enabled
    _compile_enabled = bool(enabled)


# ---------------------------------------------------------------- int8


def _onednn_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8Runtime:
    """Per-weight derived data (prepacked oneDNN weight, contiguous copies),
    rebuilt when the stored weight changes."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.zero_point: torch.Tensor | None = None
        self.inverse_f32: torch.Tensor | None = None

    def refresh(self, q_nk: torch.Tensor, inverse_scale: torch.Tensor) -> None:
        key = (q_nk._version, q_nk.data_ptr(), inverse_scale._version, inverse_scale.data_ptr())
        if key == self._key:
            return
        self.inverse_f32 = inverse_scale.float().contiguous()
        self.packed = None
        if q_nk.device.type == "cpu" and _onednn_available():
            try:
                packed = torch.ops.onednn.qlinear_prepack(
                    q_nk.contiguous(), [_ONEDNN_MIN_ROWS * 16, q_nk.shape[1]]
                )
                self.packed = packed
                self.zero_point = torch.zeros(1, dtype=torch.int32)
            except RuntimeError:
                self.packed = None
        self._key = key


def _int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0 and k >= 16
    return False


def int8_linear(
    x: torch.Tensor,
    q_nk: torch.Tensor,
    inverse_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    runtime: Int8Runtime,
) -> torch.Tensor:
    """W8A8 dynamic: `x` quantized per row, times the int8 weight `q_nk`
    ((N, K), `W ≈ q / scale`, `inverse_scale = 1 / scale`), plus `bias`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = q_nk.shape[0]
    runtime.refresh(q_nk, inverse_scale)
    if runtime.packed is not None and m >= _ONEDNN_MIN_ROWS:
        xu, row_inverse = _run_fused(_quantize_rows_uint8, x2)
        y = torch.ops.onednn.qlinear_pointwise(
            xu,
            1.0,
            128,
            runtime.packed,
            runtime.inverse_f32,
            runtime.zero_point,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
        out = _run_fused(_rescale, y, row_inverse, None, bias, out_dtype)
    else:
        xq, row_inverse = _run_fused(_quantize_rows_int8, x2)
        if _int_mm_supported(m, k, n, x2.device):
            accumulated = torch._int_mm(xq, q_nk.t())
        else:
            accumulated = xq.float() @ q_nk.float().t()
        out = _run_fused(_rescale, accumulated, row_inverse, runtime.inverse_f32, bias, out_dtype)
    return out.reshape(*shape[:-1], n)


def int8_weight_only_linear(
    x: torch.Tensor,
    q_nk: torch.Tensor,
    inverse_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x @ (q / scale).T + bias` with the activations left unquantized."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = q_nk.shape[0]
    if (
        x2.device.type == "cpu"
        and x2.dtype in (torch.bfloat16, torch.float16)
        and x2.shape[0] <= _WEIGHT_INT8PACK_MAX_ROWS
    ):
        y = torch.ops.aten._weight_int8pack_mm(
            x2.contiguous(), q_nk.contiguous(), inverse_scale.to(x2.dtype)
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        out = y.to(out_dtype)
    else:
        y = F.linear(x2, q_nk.to(x2.dtype))
        out = _run_fused(
            _rescale, y, inverse_scale.to(torch.float32)[None, :], None, bias, out_dtype
        )
    return out.reshape(*shape[:-1], n)


# ---------------------------------------------------------------- int4


class Int4Runtime:
    """The CPU int4 kernel's packed weight and scale/zero tensor, rebuilt when
    the stored weight changes; `None` when the kernel does not apply."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None
        self.group_size = 0

    def refresh(
        self,
        q_nk: Callable[[], torch.Tensor],
        tensors: tuple[torch.Tensor, ...],
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        block_size: int,
        n: int,
        k: int,
    ) -> None:
        key = tuple(t._version for t in tensors) + tuple(t.data_ptr() for t in tensors)
        if key == self._key:
            return
        self._key = key
        self.packed = None
        device = scale.device
        if device.type != "cpu" or n % 16:
            return
        if block_size > 0:
            if block_size not in _INT4_KERNEL_BLOCKS or k % block_size:
                return
            group = block_size
            scale_bf16 = scale.to(torch.bfloat16)  # (G, N)
            # The offset comes from the rounded scale, so that (u - 8) * s + z is
            # exactly (q - zero) * s for the s the kernel uses.
            kernel_zero = (-zero.float() * scale_bf16.float()).to(torch.bfloat16)
        else:
            group = next((g for g in _INT4_KERNEL_BLOCKS if k % g == 0), 0)
            if not group:
                return
            scale_bf16 = (1.0 / scale.float())[None, :].expand(k // group, n).to(torch.bfloat16)
            kernel_zero = torch.zeros_like(scale_bf16)
        unsigned = (q_nk().to(torch.int32) + 8).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        self.scales_and_zeros = torch.stack([scale_bf16, kernel_zero], dim=-1).contiguous()
        self.group_size = group


def int4_linear(
    x: torch.Tensor,
    q_nk: Callable[[], torch.Tensor],
    tensors: tuple[torch.Tensor, ...],
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    runtime: Int4Runtime,
) -> torch.Tensor:
    """`x @ W.T + bias` for int4 weights `W` (grouped: `(q - zero) * scale`
    along the input axis in blocks; per channel: `q / scale`). `q_nk()` unpacks
    the stored weight to int8 values of shape (N, K), only when needed."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    k = x2.shape[1]
    runtime.refresh(q_nk, tensors, scale, zero, block_size, n, k)
    if runtime.packed is not None and x2.dtype == torch.bfloat16:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2 if x2.is_contiguous() else x2.contiguous(),
            runtime.packed,
            runtime.group_size,
            runtime.scales_and_zeros,
        )
        if bias is not None:
            y.add_(bias)
        out = y if y.dtype == out_dtype else y.to(out_dtype)
    else:
        weight = dequantize_int4(q_nk(), scale, zero, block_size).to(x2.dtype)
        out = F.linear(x2, weight, None if bias is None else bias.to(x2.dtype)).to(out_dtype)
    return out.reshape(*shape[:-1], n)


def dequantize_int4(
    q_nk: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """The float32 (N, K) weight of int4 values `q_nk` with Keras's scales:
    grouped `scale`/`zero` of shape (G, N), or per-channel `scale` (N,)."""
    if block_size > 0:
        return dequantize_grouped(q_nk.t(), scale, zero, block_size).t()
    return q_nk.float() / scale.float()[:, None]
