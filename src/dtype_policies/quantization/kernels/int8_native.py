"""Exact int8 x int8 products on this library's AVX2 kernel
(`_csrc/int8_avx2.cpp`): the integer accumulators of the W8A8 product on x86
CPUs without VNNI, where the u8 x s8 instructions torch's and oneDNN's int8
kernels use add pairs of products in saturating 16-bit sums.

The kernel moves each weight's sign onto the activation (`vpsignb`) and
multiplies magnitudes (`vpmaddubsw`): a pair sum is at most 2 * 128 * 127,
below 2**15, so every product and sum is exact; the int32 accumulators are
those of `torch._int_mm`, bit for bit. One instruction multiplies 4 inputs by
8 output columns; a micro-kernel keeps 4 rows by 16 columns in registers.
Any int8 weight; activations in [-127, 127] (the W8A8 rounding's range; the
operator refuses -128).

`pack` lays the weight out with plain tensor ops (a frozen compiled graph
folds it into a constant); `int8_mm` is the operator
`torch.ops.dtype_policies.int8_mm_avx2`, eager and compiled alike.
`int8_mm_q8` (`int8_mm_q8_avx2`) is the W8A8 product with the inputs
rounded per block of 32 (`Int8QuantizationConfig(activation_block_size=32)`):
the same weight layout, any x86 CPU with AVX2 and FMA. `int8_mm_q8b`
(`int8_mm_q8b_avx2`) is the same product for weights with a step per block
of inputs too (`block_size=32`, the default int8: llama.cpp's Q8_0 x Q8_0),
the steps laid out by `pack_block_steps`. On CPUs with AVX-512 VNNI both run
as their `_vnni` twins (`int8_mm_q8_vnni`, `int8_mm_q8b_vnni`: one `vpdpbusd`
where AVX2 needs three instructions; the same values bit for bit), chosen from
the processor's features (`native.operator_suffix`). On AMX CPUs they run
as their `_amx` twins (`int8_mm_q8_amx`, `int8_mm_q8b_amx`,
`_csrc/int8_amx.inc`: one `tdpbssd` per 16 rows x 16 columns x block of 32
inputs, on the same packed weight, then the VNNI copy's per-block epilogue;
the same values bit for bit, 2.1-3.3x the VNNI copy from 32 rows, about 0.5x
a bfloat16 GEMM from 128; `benchmarks/amx_int8.py`), which take
`AMX_MIN_ROWS` as their last argument and run the VNNI copy below that many
rows: the choice by rows is made inside the operator, so a compiled graph
with a dynamic number of rows holds no guard on it (`blocked_suffix`).

>>> import torch
>>> from dtype_policies.quantization.kernels import int8_native
>>> q = torch.tensor([[1, -2, 3], [127, -127, 0]], dtype=torch.int8)
>>> int8_native.pack(q).shape  # one panel of 16 columns, K padded to 4
torch.Size([1, 64])
>>> if int8_native.available():
...     xq = torch.tensor([[-127, 5, 1]], dtype=torch.int8)
...     assert int8_native.int8_mm(xq, int8_native.pack(q), 2).tolist() == [[-134, -16764]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import _native as native
from dtype_policies._cpu import Processor, processor

KERNEL = "avx2"
PANEL = 16  # output columns per panel of the packed weight
# From this many rows the blocked products run their AMX copy on AMX CPUs
# (1.4-1.8x the VNNI copy at 8 rows on 1 thread, 1.1-1.9x on 2; 0.5-0.9x at
# 1-4 rows: `benchmarks/amx_int8.py`).
AMX_MIN_ROWS = 8


def available() -> bool:
    """Whether the kernel runs here: an x86 CPU with AVX2 and FMA, the
    library built (the first call builds it)."""
    return native.available(KERNEL)


def pack(q_nk: torch.Tensor) -> torch.Tensor:
    """The kernel's (ceil(N / 16), Kp * 16) int8 weight from an (N, K) int8
    matrix (Kp: K rounded up to a multiple of 4; padded columns and inputs
    are zeros). Byte order: `_csrc/int8_avx2.cpp`."""
    n, k = q_nk.shape
    kp = -(-k // 4) * 4
    panels = -(-n // PANEL)
    # Only ops on the stored values and Python scalars, so that a frozen
    # graph folds the packing into a constant.
    padded = F.pad(q_nk, (0, kp - k, 0, panels * PANEL - n))
    # [p, h, c, j, t] -> [p, j, h, c, t]: 4 inputs of 8 columns per 32 bytes
    tiles = padded.view(panels, 2, 8, kp // 4, 4).permute(0, 3, 1, 2, 4)
    return tiles.reshape(panels, kp * PANEL).contiguous()


def int8_mm(xq: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`xq` (M, K) int8 in [-127, 127] times the packed weight: the exact
    (M, n) int32 sums."""
    return _ops().int8_mm_avx2(xq, packed, n)


def int8_mm_q8(
    x: torch.Tensor,
    packed: torch.Tensor,
    column_step: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    bf16_out: bool,
) -> torch.Tensor:
    """`x` (M, K) bfloat16 rounded to int8 per block of 32 inputs
    (`epilogues.round_activation_blocks`) times the packed weight, block by
    block in integers, each block's sum scaled by its step in float32; then
    `* column_step + bias` ((n,) float32): (M, n) float32, or bfloat16 with
    `bf16_out`. A row holding a NaN or an infinity gives NaN."""
    suffix = blocked_suffix()
    return getattr(_ops(), f"int8_mm_q8_{suffix}")(
        x, packed, column_step, bias, n, bf16_out, *_rows_argument(suffix)
    )


def pack_block_steps(block_step: torch.Tensor, block_size: int, k: int) -> torch.Tensor:
    """The kernel's (ceil(N / 16), ceil(K / 32) * 16) float32 steps from
    the (N, ceil(K / block_size)) steps of a weight quantized per block of
    `block_size` inputs (a multiple of 32): for each panel of 16 columns,
    each block of 32 inputs' 16 steps (its weight block's), so the kernel
    reads them in order with the panel; padded columns zeros. Plain tensor
    ops (a frozen graph folds them into a constant)."""
    n = block_step.shape[0]
    blocks, panels = -(-k // 32), -(-n // PANEL)
    per_32 = block_step.float().repeat_interleave(block_size // 32, dim=1)[:, :blocks]
    padded = F.pad(per_32, (0, 0, 0, panels * PANEL - n))  # (panels * 16, blocks)
    return padded.view(panels, PANEL, blocks).transpose(1, 2).reshape(panels, blocks * PANEL)


def int8_mm_q8b(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_step: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    bf16_out: bool,
) -> torch.Tensor:
    """`int8_mm_q8` for a weight with a step per block of inputs and column
    (`pack_block_steps`): `y[m, c] = sum_b d[m, b] * block_step[b, c] *
    (xq[m, b] . w[c, b]) + bias[c]`."""
    suffix = blocked_suffix()
    return getattr(_ops(), f"int8_mm_q8b_{suffix}")(
        x, packed, block_step, bias, n, bf16_out, *_rows_argument(suffix)
    )


def blocked_suffix(cpu: Processor | None = None) -> str:
    """Which operator of `int8_mm_q8` and `int8_mm_q8b` runs on `cpu`
    (default this one): `"amx"` on AMX CPUs (its tiles from `AMX_MIN_ROWS`
    rows, the VNNI copy below: chosen inside the operator), else
    `native.operator_suffix`'s.

    >>> from dataclasses import replace
    >>> amx = replace(processor(), features=frozenset({"avx2", "avx512", "avx512_vnni", "amx"}))
    >>> blocked_suffix(amx)
    'amx'
    >>> blocked_suffix(replace(amx, features=frozenset({"avx2", "avx512", "avx512_vnni"})))
    'vnni'
    """
    cpu = processor() if cpu is None else cpu
    return "amx" if "amx" in cpu.features else native.operator_suffix(cpu)


def _rows_argument(suffix: str) -> tuple[int, ...]:
    """The AMX operators' last argument: the rows from which their tiles run."""
    return (AMX_MIN_ROWS,) if suffix == "amx" else ()


def _ops() -> Any:
    if native.library(KERNEL) is None:
        raise RuntimeError(
            "the int8 AVX2 kernel is not available on this machine (see the warning of its build)"
        )
    return torch.ops.dtype_policies


def _product_fake(xq: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return xq.new_empty((xq.shape[0], n), dtype=torch.int32)


def _blocked_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    column_step: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    bf16_out: bool,
    min_rows: int = 0,
) -> torch.Tensor:
    dtype = torch.bfloat16 if bf16_out else torch.float32
    return x.new_empty((x.shape[0], n), dtype=dtype)


# shapes for compilers (the operators come from the built library)
native.register_fakes(
    KERNEL,
    {
        "dtype_policies::int8_mm_avx2": _product_fake,
        **{
            f"dtype_policies::int8_mm_{kind}_{suffix}": _blocked_fake
            for kind in ("q8", "q8b")
            for suffix in ("avx2", "vnni", "amx")
        },
    },
)
