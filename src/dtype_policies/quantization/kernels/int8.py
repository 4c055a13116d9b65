"""int8 products.

W8A8 dynamic (Keras's convention `y = acc / (x_scale * w_scale) + b`):
  * CPU, 16 rows or more: oneDNN's `qlinear_pointwise` on a prepacked weight,
    with activations as uint8 (q + 128, zero point 128), the fastest int8 GEMM
    on x86 (VNNI);
  * CPU, fewer rows: `torch._int_mm` on the (N, K) weight's transposed view;
  * elsewhere: `torch._int_mm` where CUDA accepts the shape, else exact
    integer arithmetic in float32.
Weight-only: `_weight_int8pack_mm` for bfloat16/float16 activations of a few
  rows on CPU (within the shapes it supports), else the product with the int8
  weight cast to the compute dtype and the per-channel scale applied after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtype_policies.quantization.kernels import epilogues, tensor_key

ONEDNN_MIN_ROWS = 16
WEIGHT_INT8PACK_MAX_ROWS = 16


def _onednn_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8Runtime:
    """Derived data of one int8 weight (the contiguous (N, K) matrix, the
    oneDNN prepacked weight, the float32 column steps), rebuilt whenever the
    stored tensors change. Never stored; never the only copy of anything."""

    __slots__ = ("_key", "column_step", "packed", "q_nk", "zero_point")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.q_nk: torch.Tensor | None = None
        self.column_step: torch.Tensor | None = None
        self.zero_point: torch.Tensor | None = None

    def refresh(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        to_nk: Callable[[torch.Tensor], torch.Tensor],
        prepack: bool,
    ) -> None:
        """Rebuilds the derived data if the stored `data`/`scale` changed;
        `to_nk` views `data` as (N, K)."""
        key = (*tensor_key(data, scale), prepack)
        if key == self._key:
            return
        with torch.inference_mode(False), torch.no_grad():
            q_nk = to_nk(data)
            self.q_nk = q_nk.contiguous()
            self.column_step = (1.0 / scale.float()).contiguous()
            self.packed = None
            if prepack and q_nk.device.type == "cpu" and _onednn_available():
                try:
                    self.packed = torch.ops.onednn.qlinear_prepack(
                        self.q_nk, [ONEDNN_MIN_ROWS * 16, q_nk.shape[1]]
                    )
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
    x2: torch.Tensor,
    runtime: Int8Runtime,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """W8A8 dynamic on a 2-D `x2` (M, K), with the runtime refreshed."""
    m, k = x2.shape
    q_nk = runtime.q_nk
    n = q_nk.shape[0]
    if m == 0:
        return x2.new_zeros((0, n), dtype=out_dtype)
    if runtime.packed is not None and m >= ONEDNN_MIN_ROWS:
        xu, row_step = epilogues.run(epilogues.quantize_rows_uint8, x2)
        # oneDNN applies the per-channel weight steps and writes the output
        # dtype directly; the per-row steps and the bias follow in place.
        y = torch.ops.onednn.qlinear_pointwise(
            xu,
            1.0,
            128,
            runtime.packed,
            runtime.column_step,
            runtime.zero_point,
            None,
            1.0,
            0,
            out_dtype,
            "none",
            [],
            "",
        )
        y.mul_(row_step)
        if bias is not None:
            y.add_(bias)
        return y
    xq, row_step = epilogues.run(epilogues.quantize_rows_int8, x2)
    if _int_mm_supported(m, k, n, x2.device):
        accumulated = torch._int_mm(xq, q_nk.t())
    else:
        accumulated = xq.float() @ q_nk.float().t()
    return epilogues.run(
        epilogues.rescale, accumulated, row_step, runtime.column_step, bias, out_dtype
    )


def int8_linear_traceable(
    x2: torch.Tensor,
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    weight_only: bool,
) -> torch.Tensor:
    """The int8 product in plain ops on the stored tensors, for compilers and
    tracers (no derived runtime data, no opaque kernels)."""
    column_step = 1.0 / scale.float()
    if weight_only:
        y = F.linear(x2, q_nk.to(x2.dtype))
        return epilogues.rescale(y, column_step[None, :], None, bias, out_dtype)
    xq, row_step = epilogues.quantize_rows_int8(x2)
    m, k = x2.shape
    if _int_mm_supported(m, k, q_nk.shape[0], x2.device):
        accumulated = torch._int_mm(xq, q_nk.t())
    else:
        accumulated = xq.float() @ q_nk.float().t()
    return epilogues.rescale(accumulated, row_step, column_step, bias, out_dtype)


def fake_quantize_rows_int8(x2: torch.Tensor) -> torch.Tensor:
    """`x2` rounded as the W8A8 product sees it (per row, in `x2`'s dtype)."""
    q, step = epilogues.quantize_rows_int8(x2)
    return (q.float() * step).to(x2.dtype)


def weight_int8pack_supported(x2: torch.Tensor, n: int) -> bool:
    """Shapes and dtypes `_weight_int8pack_mm` handles correctly on CPU. Its
    AVX-512 bfloat16 kernel reads the activations with aligned 32-byte loads:
    K must be a multiple of 16 (other K crash or return garbage, measured) and
    the activations 32-byte aligned (`int8_weight_only_linear` copies them
    when they are not)."""
    m, k = x2.shape
    return (
        x2.device.type == "cpu"
        and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 0 < m <= WEIGHT_INT8PACK_MAX_ROWS
        and k % 16 == 0
        and n % 16 == 0
    )


def int8_weight_only_linear(
    x2: torch.Tensor,
    runtime: Int8Runtime,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x2 @ (q / scale).T + bias` with the activations left unquantized."""
    q_nk = runtime.q_nk
    n = q_nk.shape[0]
    if weight_int8pack_supported(x2, n):
        x2 = x2.contiguous()
        if x2.data_ptr() % 32:
            x2 = x2.clone()  # a fresh allocation is aligned
        y = torch.ops.aten._weight_int8pack_mm(x2, q_nk, runtime.column_step.to(x2.dtype))
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype)
    y = F.linear(x2, q_nk.to(x2.dtype))
    return epilogues.run(epilogues.rescale, y, runtime.column_step[None, :], None, bias, out_dtype)
