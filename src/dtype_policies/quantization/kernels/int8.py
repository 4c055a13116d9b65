"""int8 products, on the path chosen once per weight from what the processor
can do (`dtype_policies._cpu.processor()`).

W8A8 dynamic (Keras's convention `y = acc / (x_scale * w_scale) + b`), exact
integer accumulation on every CPU class (`Int8Runtime.w8a8_path`):
  * weights of `ONEDNN_MIN_ELEMENTS` or more, x86: oneDNN's
    `qlinear_pointwise` on a prepacked weight. With AMX: uint8 activations
    (q + 128, zero point 128) below `ONEDNN_S8_MIN_ROWS` rows, int8 ones
    (no zero point) from there where torch's oneDNN op takes them
    (`signed_onednn_applies`; else uint8 at every row count); with VNNI:
    uint8 from `ONEDNN_MIN_ROWS` rows,
    `torch._int_mm` below. Without VNNI (AVX2, AVX-512 before Cascade Lake),
    x86 int8 kernels add adjacent u8 x s8 products in saturating 16-bit sums:
    this library's AVX2 s8 x s8 kernel (`int8_native`: each weight's sign
    moved onto the activation, pair sums below 2**15, exact) at every row
    count and size where it is built; else the activations are split by
    sign (`x = x+ - x-`, each in [0, 127], stacked as 2M rows with zero
    point 0), so that a pair stays below
    2 * 127 * 127 < 32767 and the sums are exact; the accumulators come back
    as float32 integers, `x+` rows minus `x-` rows;
  * smaller weights: `torch._int_mm` where products are exact (VNNI, AMX,
    aarch64, CUDA where it accepts the shape), else exact integer arithmetic
    in float32 (float64 beyond 2**24);
  oneDNN writes bfloat16 outputs itself only where its bfloat16 is native.
W8A8 with the activations rounded per block of 32 inputs
  (`activation_block_size=32`), the weights per channel or per block of
  inputs too (`block_size=32`: the default int8, llama.cpp's Q8_0 x Q8_0):
  this library's AVX2 kernels (`int8_native.int8_mm_q8`, `int8_mm_q8b`) on
  any x86 CPU with AVX2 and FMA, VNNI or not; elsewhere the rounded
  activations times the int8 weight in floating point
  (`round_activation_blocks`, then the weight-only product's cast, per-block
  steps applied chunk by chunk with it). These products, and the traced
  path's, run in float32 on every CPU class: the rounded activations (an
  int8 value times its block's float32 step) and the weights scaled per
  block are not bfloat16 values, and rounding them for a bfloat16 product
  moved the results 2**-9 off the kernel's exact integer sums, which the
  next layer's activation rounding turned into whole steps (an exported int8
  MLP 8e-3 from eager where bfloat16 products are native, 0 elsewhere).
Weight-only: `_weight_int8pack_mm` for bfloat16/float16 activations of a few
  rows on CPU (within the shapes it supports); float32 activations of fewer
  rows are rounded to bfloat16 for it (its float32 variant is scalar code),
  the output scaled in float32 after (a relative 2**-9 on inputs and sums,
  small against int8's own error of about 1%), as int4 does; else the product with the int8
  weight cast per call, chunk by chunk while it is in cache, to the compute
  dtype (to float32 where half-precision products are emulated), the
  per-channel scale applied after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtype_policies._compat import ONEDNN_QLINEAR_TAKES_INT8_ACTIVATIONS
from dtype_policies._core.casting import (
    as_product_input,
    bfloat16_rounded,
    exporting,
    float32_values,
    plus_bias,
    straight_through,
)
from dtype_policies._core.products import native_half_products, product_dtype
from dtype_policies._cpu import Processor, processor
from dtype_policies.quantization.kernels import (
    epilogues,
    freezing_weights,
    int8_native,
    tensor_key,
)
from dtype_policies.quantizers.math import expand_blocks

# oneDNN's int8 product pays off for weights of at least this many elements;
# below it `torch._int_mm` (exact classes) or exact float products (no VNNI)
# are faster at any row count (1 thread, AMX, AVX-512 VNNI and AVX2 classes).
ONEDNN_MIN_ELEMENTS = 1 << 18
# ... and, without AMX, from this many rows (`torch._int_mm` is faster below).
ONEDNN_MIN_ROWS = 4
# With AMX, signed activations (no zero point to compensate) are faster from
# this many rows (1 thread: 1.2-1.5x at 16-128 rows); oneDNN runs them on a
# scalar reference kernel without AMX (100-1000x slower): never there.
ONEDNN_S8_MIN_ROWS = 16
WEIGHT_INT8PACK_MAX_ROWS = 16
# Float32 activations (rounded to bfloat16: `bfloat16_rounded_product`) run
# `_weight_int8pack_mm` up to this many rows where bfloat16 products are
# emulated (1 thread, avx512 and AVX2 caps: 1.4-3.7x float32 at 1-8 rows for
# 576 x 1536 to 5632 x 2048 weights, 0.7-1.6x at 16); where they are native,
# up to `WEIGHT_INT8PACK_MAX_ROWS` as bfloat16 activations do.
FLOAT32_INT8PACK_MAX_ROWS = 8

PATHS = {
    "native": "this library's AVX2 s8 x s8 kernel (exact without VNNI)",
    "onednn": "oneDNN u8 x s8 (VNNI/AMX)",
    "onednn_split": "oneDNN u8 x s8, activations split by sign (exact without VNNI)",
    "onednn_s8": "oneDNN s8 x s8 (AMX)",
    "int_mm": "torch._int_mm s8 x s8",
    "float": "integer values multiplied exactly in floating point",
    "native_q8": "this library's AVX2 kernel, activations rounded to int8 per 32 inputs",
    "q8_float": "activations rounded to int8 per 32 inputs, times the int8 weight in floating "
    "point",
    "int8pack": "torch._weight_int8pack_mm",
    "int8pack_bfloat16": "torch._weight_int8pack_mm on float32 activations rounded to bfloat16",
    "dequantized": "int8 weight cast to the compute dtype per call",
    "dequantized_bfloat16": "int8 weight cast per call, float32 activations and products "
    "rounded to bfloat16 (bfloat16 products where native, else float32 ones)",
    "dequantized_float32": "int8 weight cast to float32 per call (half products emulated)",
}


def _onednn_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


def onednn_int8_applies(device: torch.device, cpu: Processor) -> bool:
    """Whether oneDNN's int8 linear runs here (x86 CPUs with oneDNN)."""
    return (
        device.type == "cpu"
        and cpu.architecture == "x86_64"
        and torch.backends.mkldnn.is_available()
        and _onednn_available()
    )


def signed_onednn_applies(cpu: Processor) -> bool:
    """Whether oneDNN's int8 linear runs on int8 activations (`onednn_s8`):
    with AMX, on a torch whose `qlinear_pointwise` takes them."""
    return cpu.amx and ONEDNN_QLINEAR_TAKES_INT8_ACTIVATIONS


class Int8Runtime:
    """Derived data of one int8 weight (the contiguous (N, K) matrix, the
    oneDNN prepacked weight, the float32 column steps) and its product
    paths, chosen from the processor: rebuilt whenever the stored tensors
    change or the processor description does. Never stored; never the only
    copy of anything."""

    __slots__ = (
        "_key",
        "amx",
        "block_size",
        "block_step",
        "column_step",
        "exact",
        "large",
        "native",
        "ones",
        "packed",
        "q_nk",
        "signed",
        "zero_point",
    )

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.native: torch.Tensor | None = None
        self.q_nk: torch.Tensor | None = None
        self.column_step: torch.Tensor | None = None
        self.block_step: torch.Tensor | None = None
        self.block_size: int | None = None
        self.zero_point: torch.Tensor | None = None
        self.ones: torch.Tensor | None = None
        self.exact = True
        self.amx = False
        self.signed = False  # oneDNN on int8 activations from `ONEDNN_S8_MIN_ROWS` rows
        self.large = False

    @property
    def split(self) -> bool:
        """Whether oneDNN runs on activations split by sign (no VNNI)."""
        return self.packed is not None and not self.exact

    def refresh(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        to_nk: Callable[[torch.Tensor], torch.Tensor],
        prepack: bool,
        blocked: bool = False,
        block_size: int | None = None,
    ) -> None:
        """Rebuilds the derived data if the stored `data`/`scale` changed;
        `to_nk` views `data` as (N, K). `prepack`: for the W8A8 paths;
        `blocked`: for the per-block W8A8 kernel; `block_size`: the weight's
        steps per block of that many inputs (`scale` (N, blocks)), else per
        channel."""
        cpu = processor()
        key = (*tensor_key(data, scale), prepack, blocked, block_size, cpu)
        if key == self._key:
            return
        with torch.inference_mode(False), torch.no_grad():
            q_nk = to_nk(data).contiguous()
            if q_nk.data_ptr() % 16:  # see `weight_int8pack_supported`
                q_nk = q_nk.clone()  # a fresh allocation is aligned
            column_step = (1.0 / scale.float()).contiguous()
            # u8 x s8 products saturate in 16-bit pair sums on x86 CPUs without
            # VNNI; elsewhere (and on other devices) integer products are exact.
            exact = cpu.exact_int8 or q_nk.device.type != "cpu"
            # (exact float products of a small weight beyond 2**24 need float64)
            large = q_nk.numel() >= ONEDNN_MIN_ELEMENTS or (
                not exact and q_nk.shape[1] > FLOAT32_EXACT_TERMS
            )
            packed = zero_point = ones = native = block_step = None
            per_block = blocked and blocked_kernel_applies(q_nk.device)
            if per_block or (prepack and native_applies(q_nk.device, cpu)):
                native = int8_native.pack(q_nk)
            elif prepack and onednn_int8_applies(q_nk.device, cpu):
                packed = torch.ops.onednn.qlinear_prepack(
                    q_nk, [ONEDNN_MIN_ROWS * 16, q_nk.shape[1]]
                )
                zero_point = torch.zeros(1, dtype=torch.int32)
                ones = torch.ones(q_nk.shape[0])
            if per_block and block_size is not None:
                block_step = int8_native.pack_block_steps(column_step, block_size, q_nk.shape[1])
        # Every field goes from one valid value to the next (never through
        # None): a thread reading while another rebuilds sees either.
        self.q_nk, self.column_step, self.zero_point, self.ones = (
            q_nk,
            column_step,
            zero_point,
            ones,
        )
        self.exact, self.amx, self.large, self.packed = exact, cpu.amx, large, packed
        self.signed = signed_onednn_applies(cpu)
        self.native, self.block_step, self.block_size = native, block_step, block_size
        self._key = key

    def w8a8_paths(self) -> tuple[str, ...]:
        """The W8A8 paths that give exact products for this weight here."""
        paths = [] if self.native is None else ["native"]
        if self.packed is not None:
            paths += ["onednn", "onednn_split"] if self.exact else ["onednn_split"]
            if self.signed:
                paths.append("onednn_s8")
        if self.exact:
            paths.append("int_mm")
        return (*paths, "float")

    def w8a8_path(self, rows: int) -> str:
        """The W8A8 path (a key of `PATHS`) for `rows` rows: without VNNI this
        library's AVX2 kernel where it is built (any rows, any size: 1.2-2.3x
        float32's product at 32-4096 rows, measured on AMD Zen 3); else oneDNN
        for large weights (with AMX at any rows, signed from
        `ONEDNN_S8_MIN_ROWS` where `signed_onednn_applies`; with VNNI from
        `ONEDNN_MIN_ROWS`; on split activations without VNNI); `torch._int_mm`
        for the rest where products are exact, exact float products where
        they are not."""
        if self.native is not None:
            return "native"
        if self.packed is not None and self.large:
            if not self.exact:
                return "onednn_split"
            if self.amx:
                return "onednn_s8" if self.signed and rows >= ONEDNN_S8_MIN_ROWS else "onednn"
            if rows >= ONEDNN_MIN_ROWS:
                return "onednn"
        return "int_mm" if self.exact else "float"


def native_applies(device: torch.device, cpu: Processor) -> bool:
    """Whether W8A8 runs on this library's AVX2 kernel: a CPU whose int8
    instructions saturate (no VNNI), with the kernel built."""
    return device.type == "cpu" and not cpu.exact_int8 and int8_native.available()


def blocked_kernel_applies(device: torch.device) -> bool:
    """Whether per-block W8A8 runs on this library's AVX2 kernel: any x86
    CPU with AVX2 and FMA, the kernel built."""
    return device.type == "cpu" and int8_native.available()


def _int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    if device.type == "cpu":
        return processor().exact_int8
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0 and k >= 16
    return False


def _qlinear(
    activations: torch.Tensor,
    zero_point: int,
    runtime: Int8Runtime,
    weight_steps: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(
        activations,
        1.0,
        zero_point,
        runtime.packed,
        weight_steps,
        runtime.zero_point,
        None,
        1.0,
        0,
        out_dtype,
        "none",
        [],
        "",
    )


def _onednn(x2, runtime, bias, out_dtype, signed=False):
    if signed:  # s8 activations, no zero point (AMX only)
        xq, row_step = epilogues.run(epilogues.quantize_rows_int8, x2)
    else:  # u8 activations, zero point 128
        xq, row_step = epilogues.run(epilogues.quantize_rows_uint8, x2)
    # oneDNN writes the integer sums in float32 (steps of 1), and the steps
    # and the bias follow as on every other path, in the same order: a row's
    # values do not depend on how many rows share the call (with oneDNN's
    # column steps inside, 4 rows and more differed from 1-3 rows in the last
    # bit; written in bfloat16 by oneDNN, rounded three times).
    zero_point = 0 if signed else 128
    accumulated = _qlinear(xq, zero_point, runtime, runtime.ones, torch.float32)
    return epilogues.run(
        epilogues.rescale, accumulated, row_step, runtime.column_step, bias, out_dtype
    )


def _onednn_split(x2, runtime, bias, out_dtype):
    u, row_step = epilogues.run(epilogues.quantize_rows_split_uint8, x2)
    both = _qlinear(u, 0, runtime, runtime.ones, torch.float32)
    m = x2.shape[0]
    accumulated = both[:m].sub_(both[m:])  # integers, exact below 2**24
    return epilogues.run(
        epilogues.rescale, accumulated, row_step, runtime.column_step, bias, out_dtype
    )


def int_mm(xq: torch.Tensor, q_nk: torch.Tensor) -> torch.Tensor:
    """`torch._int_mm(xq, q_nk.t())`, exact on every layout. torch's kernel
    misreads an operand with a dimension of 1 whose strides are ambiguous: a
    row stored as a transposed column (strides (1, 1)), and any K = 1; such a
    row is copied to its canonical layout, and K = 1 takes the exact float
    product (float32, exact: the sums are the same integers).

    >>> xq = torch.tensor([[3], [-2], [5]], dtype=torch.int8).t()  # strides (1, 1)
    >>> q_nk = torch.tensor([[1, 2, 3], [-1, 0, 1]], dtype=torch.int8)
    >>> int_mm(xq, q_nk).tolist(), int_mm(xq.t(), q_nk[:, :1]).int().tolist()
    ([[14, 2]], [[3, -3], [-2, 2], [5, -5]])
    """
    rows, k = xq.shape
    if k == 1:
        return exact_float_product(xq, q_nk)
    if rows == 1 and xq.stride() != (k, 1):
        xq = torch.empty((1, k), dtype=xq.dtype, device=xq.device).copy_(xq)
    return torch._int_mm(xq, q_nk.t())


def _integer(x2, runtime, bias, out_dtype, use_int_mm):
    xq, row_step = epilogues.run(epilogues.quantize_rows_int8, x2)
    q_nk = runtime.q_nk
    if use_int_mm and _int_mm_supported(*x2.shape, q_nk.shape[0], x2.device):
        accumulated = int_mm(xq, q_nk)
    else:
        accumulated = exact_float_product(xq, q_nk)
    return epilogues.run(
        epilogues.rescale, accumulated, row_step, runtime.column_step, bias, out_dtype
    )


def _native(x2, runtime, bias, out_dtype):
    xq, row_step = epilogues.run(epilogues.quantize_rows_int8, x2)
    accumulated = int8_native.int8_mm(xq, runtime.native, runtime.q_nk.shape[0])
    return epilogues.run(
        epilogues.rescale, accumulated, row_step, runtime.column_step, bias, out_dtype
    )


_W8A8 = {
    "native": _native,
    "onednn": _onednn,
    "onednn_split": _onednn_split,
    "onednn_s8": lambda x2, runtime, bias, out_dtype: _onednn(x2, runtime, bias, out_dtype, True),
    "int_mm": lambda x2, runtime, bias, out_dtype: _integer(x2, runtime, bias, out_dtype, True),
    "float": lambda x2, runtime, bias, out_dtype: _integer(x2, runtime, bias, out_dtype, False),
}


def int8_linear(
    x2: torch.Tensor,
    runtime: Int8Runtime,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    path: str | None = None,
) -> torch.Tensor:
    """W8A8 dynamic on a 2-D `x2` (M, K), with the runtime refreshed, by
    `path` (default: the runtime's choice for M rows; one of its
    `w8a8_paths()`)."""
    if path is not None and path not in runtime.w8a8_paths():
        raise ValueError(
            f"W8A8 path {path!r} does not run for this weight here; "
            f"expected one of {runtime.w8a8_paths()}"
        )
    m = x2.shape[0]
    if m == 0:
        return x2.new_zeros((0, runtime.q_nk.shape[0]), dtype=out_dtype)
    return _W8A8[path or runtime.w8a8_path(m)](x2, runtime, bias, out_dtype)


def _blocked_kernel(x2, packed, column_step, bias, out_dtype, n, block_step=None):
    """The per-block W8A8 kernel: per-channel `column_step`, or the packed
    `block_step` (`int8_native.pack_block_steps`) when given."""
    bias32 = None if bias is None else float32_values(bias)  # its own values, compiled too
    bf16_out = out_dtype is torch.bfloat16
    if block_step is None:
        y = int8_native.int8_mm_q8(x2.bfloat16(), packed, column_step, bias32, n, bf16_out)
    else:
        y = int8_native.int8_mm_q8b(x2.bfloat16(), packed, block_step, bias32, n, bf16_out)
    return y if y.dtype is out_dtype else y.to(out_dtype)


def blocked_paths(runtime: Int8Runtime) -> tuple[str, ...]:
    """The per-block W8A8 paths that run here (keys of `PATHS`), the chosen first."""
    return ("q8_float",) if runtime.native is None else ("native_q8", "q8_float")


def int8_blocked_linear(
    x2: torch.Tensor,
    runtime: Int8Runtime,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    path: str | None = None,
) -> torch.Tensor:
    """W8A8 with `x2` (M, K) rounded to int8 per block of 32 inputs
    (`epilogues.round_activation_blocks`), with the runtime refreshed for
    blocks, by `path` (default: the first of `blocked_paths`)."""
    q_nk, column_step = runtime.q_nk, runtime.column_step
    assert q_nk is not None and column_step is not None  # set by `refresh`
    n = q_nk.shape[0]
    if x2.shape[0] == 0:
        return x2.new_zeros((0, n), dtype=out_dtype)
    path = path or blocked_paths(runtime)[0]
    if path == "native_q8":
        assert runtime.native is not None  # `blocked_paths` offers it only then
        return _blocked_kernel(
            x2, runtime.native, column_step, bias, out_dtype, n, runtime.block_step
        )
    rounded = epilogues.round_activation_blocks(x2)  # float32 products (module docstring)
    if runtime.block_size is None:
        y = _cast_in_chunks(rounded, q_nk)
        return epilogues.rescale(y, column_step[None, :], None, bias, out_dtype)
    y = _cast_in_chunks(rounded, q_nk, column_step, runtime.block_size)
    return _plus_bias(y, bias, out_dtype)


def _plus_bias(y: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`y + bias` (in `y`'s dtype) in `out_dtype`: the per-block weights' epilogue."""
    return plus_bias(y, bias).to(out_dtype)


# Integer products of int8 values summed in float32 are exact while every
# partial sum stays below 2**24: up to this many terms at |values| <= 127.
FLOAT32_EXACT_TERMS = (1 << 24) // (127 * 127)


def exact_float_product(xq: torch.Tensor, q_nk: torch.Tensor) -> torch.Tensor:
    """`xq @ q_nk.T` of int8 matrices, exactly, in floating point (float32
    when the sums cannot leave its exact integers, else float64)."""
    dtype = torch.float32 if xq.shape[-1] <= FLOAT32_EXACT_TERMS else torch.float64
    return (xq.to(dtype) @ q_nk.to(dtype).t()).float()


def int8_linear_traceable(
    x2: torch.Tensor,
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    weight_only: bool,
    activation_block_size: int | None = None,
    block_size: int | None = None,
    needs_grad: bool = False,
) -> torch.Tensor:
    """The int8 product in plain ops on the stored tensors, for compilers and
    tracers (no derived runtime data; with frozen weights, the eager path's
    kernels on layouts the graph folds into constants). `block_size`: the
    weight's `scale` is per block of that many inputs, (N, blocks). The
    values are the eager path's with or without `needs_grad`: its roundings
    of the activations pass the gradient straight through (the gradient
    through the dequantized weight, as the eager path's)."""
    column_step = 1.0 / scale.float()
    n, k = q_nk.shape
    frozen = freezing_weights() and not needs_grad
    if activation_block_size is not None:
        if frozen and blocked_kernel_applies(x2.device):
            # the eager path's kernel, on layouts the frozen graph folds into constants
            block_step = None
            if block_size is not None:
                block_step = int8_native.pack_block_steps(column_step, block_size, k)
            return _blocked_kernel(
                x2, int8_native.pack(q_nk), column_step, bias, out_dtype, n, block_step
            )
        rounded = straight_through(
            x2.float(), epilogues.round_activation_blocks(x2, activation_block_size)
        )  # float32 products, as eager's (module docstring)
        if block_size is not None:
            weight = q_nk.float() * expand_blocks(column_step, block_size, k)
            return _plus_bias(F.linear(rounded, weight), bias, out_dtype)
        y = F.linear(rounded, q_nk.float())
        return epilogues.rescale(y, column_step[None, :], None, bias, out_dtype)
    if weight_only:
        if frozen and _frozen_int8pack(x2, q_nk.shape[0]):
            # Frozen weights (`kernels.freezing_weights`): the kernel the
            # eager path runs, on fresh (aligned) copies: freezing folds the
            # weight's into a constant once, the activations' costs one row copy.
            weight = q_nk.clone(memory_format=torch.contiguous_format)
            rows = x2.clone(memory_format=torch.contiguous_format)
            if x2.dtype is torch.float32:
                # Ones computed from the stored steps (x ** 0 is 1 for every x),
                # so that freezing folds them into a constant buffer: Inductor's
                # lowering of the op cannot take a constructor's (ones_like's)
                # unrealized values.
                ones = column_step.bfloat16().pow(0)
                y = torch.ops.aten._weight_int8pack_mm(rows.bfloat16(), weight, ones)
                return epilogues.rescale(y.float(), column_step[None, :], None, bias, out_dtype)
            y = torch.ops.aten._weight_int8pack_mm(rows, weight, column_step.to(x2.dtype))
            return plus_bias(y, bias).to(out_dtype)
        if x2.dtype is torch.float32 and x2.device.type == "cpu":  # as the eager path
            if needs_grad or exporting() or not native_half_products(torch.bfloat16, processor()):
                # float32 products, each rounding written out (a compiler
                # skips the rounding of a cast pair, and a bfloat16 product's
                # gradient would be rounded too)
                y = bfloat16_rounded(F.linear(bfloat16_rounded(x2), q_nk.float()))
            else:  # the integer weight in the activations' dtype (exact in bfloat16)
                y = F.linear(x2.bfloat16(), q_nk.bfloat16())
        else:
            dtype = product_dtype(x2.dtype, x2.device)
            y = F.linear(as_product_input(x2, dtype), q_nk.to(dtype))
        return epilogues.rescale(y, column_step[None, :], None, bias, out_dtype)
    m, k = x2.shape
    if needs_grad or exporting():
        # the integer activations in floating point: the same integer sums
        # (`exact_float_product`), in ops every exporter knows
        row_step = epilogues.row_steps(x2.detach())
        scaled = float32_values(x2) / row_step
        xq = straight_through(scaled, torch.round(scaled))
        dtype = torch.float32 if k <= FLOAT32_EXACT_TERMS else torch.float64
        accumulated = F.linear(xq.to(dtype), q_nk.to(dtype)).float()
        return epilogues.rescale(accumulated, row_step, column_step, bias, out_dtype)
    xq, row_step = epilogues.quantize_rows_int8(float32_values(x2))
    if frozen and native_applies(x2.device, processor()):
        # the eager path's kernel, on a layout the frozen graph folds into a constant
        accumulated = int8_native.int8_mm(xq, int8_native.pack(q_nk), q_nk.shape[0])
    elif _int_mm_supported(m, k, q_nk.shape[0], x2.device):
        accumulated = int_mm(xq, q_nk)
    else:
        accumulated = exact_float_product(xq, q_nk)
    return epilogues.rescale(accumulated, row_step, column_step, bias, out_dtype)


def _frozen_int8pack(x2: torch.Tensor, n: int) -> bool:
    """Whether a traced weight-only product runs `_weight_int8pack_mm`: with
    frozen weights, where the eager path would (`weight_only_path`)."""
    if not freezing_weights() or not weight_int8pack_supported(x2, n):
        return False
    return x2.dtype is not torch.float32 or x2.shape[0] <= float32_int8pack_max_rows(x2.device)


def bfloat16_rounded_product(
    x2: torch.Tensor,
    q_nk: torch.Tensor,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    cpu: Processor | None = None,
) -> torch.Tensor:
    """`product(x, q_nk)` of float32 activations on a CPU as every weight-only
    int8 path computes it, on every class and at every row count: the inputs
    rounded to bfloat16, times the integer weight (exact in bfloat16), summed
    in float32 and rounded to bfloat16 (before the per-channel step). The
    GEMMs' summation orders differ between paths (`_weight_int8pack_mm` up
    to 16 rows, a bfloat16 GEMM from 17), so a few outputs can land one
    bfloat16 step apart with the batch (docs/cpu_classes.md). Where
    bfloat16 products are native that is a bfloat16 product (1.6-2.6x a
    float32 one with the weight cast per call at 16-128 rows, 2 threads, Zen 4,
    576 x 1536 to 5632 x 2048); elsewhere float32 products of the rounded
    values give the same values. `_weight_int8pack_mm` rounds the same way. The
    rounding adds about 0.1% to outputs whose int8 weights already err by
    about 1% (SmolLM2: perplexity 25.05 against 25.03, KL 0.0055 against 0.0049)."""
    if native_half_products(torch.bfloat16, cpu or processor()):
        return product(x2.bfloat16(), q_nk)
    return product(bfloat16_rounded(x2), q_nk).bfloat16()


def float32_int8pack_max_rows(device: torch.device, cpu: Processor | None = None) -> int:
    """Up to how many rows float32 activations (rounded to bfloat16) run
    `_weight_int8pack_mm`: as bfloat16 activations where those products are
    native, else `FLOAT32_INT8PACK_MAX_ROWS`."""
    if device.type == "cpu" and native_half_products(torch.bfloat16, cpu or processor()):
        return WEIGHT_INT8PACK_MAX_ROWS
    return FLOAT32_INT8PACK_MAX_ROWS


def weight_int8pack_supported(x2: torch.Tensor, n: int, any_rows: bool = False) -> bool:
    """Shapes and dtypes `_weight_int8pack_mm` handles correctly on CPU. Its
    AVX-512 bfloat16 kernel reads the activations with aligned 32-byte loads:
    K must be a multiple of 16 (other K crash or return garbage, measured) and
    the activations 32-byte aligned (`int8_weight_only_linear` copies them
    when they are not). The weight must be 16-byte aligned (crashes measured
    on torch 2.6 for any rows, on 2.13 from 4 rows): `Int8Runtime` copies one
    that is not, e.g. a checkpoint tensor mapped at an odd file offset."""
    m, k = x2.shape
    return (
        x2.device.type == "cpu"
        and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 0 < m
        and (any_rows or m <= WEIGHT_INT8PACK_MAX_ROWS)
        and k % 16 == 0
        and n % 16 == 0
    )


def weight_only_paths(x2: torch.Tensor, runtime: Int8Runtime) -> tuple[str, ...]:
    """The weight-only paths that run `x2`'s shape and dtype here."""
    paths = []
    if weight_int8pack_supported(x2, runtime.q_nk.shape[0], any_rows=True):
        paths.append("int8pack_bfloat16" if x2.dtype is torch.float32 else "int8pack")
    if x2.dtype is torch.float32 and x2.device.type == "cpu":
        return (*paths, "dequantized_bfloat16", "dequantized")
    return (*paths, "dequantized", "dequantized_float32")


def weight_only_path(x2: torch.Tensor, runtime: Int8Runtime) -> str:
    """`_weight_int8pack_mm` for half-precision activations of a few rows
    within its shapes (its float32 variant is scalar code, 5-10x slower than
    float32's own product, measured; float32 activations are rounded to
    bfloat16 for it), else the product with the weight cast per call, chunk by
    chunk (to float32 where half-precision products are emulated; float32
    activations on a CPU as `bfloat16_rounded_product`)."""
    q_nk = runtime.q_nk
    assert q_nk is not None  # set by `refresh`
    n = q_nk.shape[0]
    if x2.dtype in (torch.bfloat16, torch.float16) and weight_int8pack_supported(x2, n):
        return "int8pack"
    if x2.dtype is torch.float32:
        if x2.shape[0] <= float32_int8pack_max_rows(x2.device) and weight_int8pack_supported(x2, n):
            return "int8pack_bfloat16"
        if x2.device.type == "cpu":
            return "dequantized_bfloat16"
    if product_dtype(x2.dtype, x2.device) is not x2.dtype:
        return "dequantized_float32"  # the same values, at float32 speed
    return "dequantized"


# The per-call cast of the weight goes chunk by chunk of about this many bytes
# (in the product dtype), so that each cast chunk is multiplied while it is in
# cache: reading 1 byte per weight from memory instead of writing and reading
# 2-4 (1 thread, 5632 x 2048: 1.0-2.2x a float32 product at 8-64 rows, against
# 0.3-0.45x casting the whole weight). Large enough to keep the number of
# products per call small (each one is a parallel region).
CHUNK_BYTES = 1 << 22


def _cast_in_chunks(
    x2: torch.Tensor,
    q_nk: torch.Tensor,
    block_step: torch.Tensor | None = None,
    block_size: int = 0,
) -> torch.Tensor:
    """`x2 @ q_nk.T` with `q_nk` cast to `x2`'s dtype chunk by chunk; with
    `block_step` ((N, blocks) float32), each weight times its block's step
    first (in float32)."""
    n, k = q_nk.shape

    def cast(start: int, stop: int) -> torch.Tensor:
        chunk = q_nk[start:stop]
        if block_step is None:
            return chunk.to(x2.dtype)
        steps = expand_blocks(block_step[start:stop], block_size, k)
        return (chunk.float() * steps).to(x2.dtype)

    rows = max(16, CHUNK_BYTES // (k * x2.element_size()))
    if rows >= n or x2.device.type != "cpu":
        return F.linear(x2, cast(0, n))
    parts = [F.linear(x2, cast(i, i + rows)) for i in range(0, n, rows)]
    return torch.cat(parts, dim=1)


def _aligned(x2: torch.Tensor) -> torch.Tensor:
    """`x2`, contiguous and 32-byte aligned (see `weight_int8pack_supported`)."""
    x2 = x2.contiguous()
    return x2.clone() if x2.data_ptr() % 32 else x2  # a fresh allocation is aligned


def int8_weight_only_linear(
    x2: torch.Tensor,
    runtime: Int8Runtime,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    path: str | None = None,
) -> torch.Tensor:
    """`x2 @ (q / scale).T + bias` with the activations left unquantized, by
    `path` (default: `weight_only_path`)."""
    q_nk = runtime.q_nk
    assert q_nk is not None  # set by `refresh`
    n = q_nk.shape[0]
    if x2.shape[0] == 0:
        return x2.new_zeros((0, n), dtype=out_dtype)
    path = path or weight_only_path(x2, runtime)
    if path == "int8pack":
        y = torch.ops.aten._weight_int8pack_mm(_aligned(x2), q_nk, runtime.column_step.to(x2.dtype))
        return plus_bias(y, bias).to(out_dtype)
    if path == "int8pack_bfloat16":
        column_step = runtime.column_step
        assert column_step is not None  # set with q_nk by `refresh`
        ones = torch.ones_like(column_step, dtype=torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(_aligned(x2.bfloat16()), q_nk, ones)
        return epilogues.run(
            epilogues.rescale, y.float(), column_step[None, :], None, bias, out_dtype
        )
    if path == "dequantized_float32":
        x2 = x2.float()
    if path == "dequantized_bfloat16":
        y = bfloat16_rounded_product(x2, q_nk, _cast_in_chunks)
    else:
        y = _cast_in_chunks(x2, q_nk)
    return epilogues.run(epilogues.rescale, y, runtime.column_step[None, :], None, bias, out_dtype)
