"""The int4 product on this library's AVX2 kernel (`csrc/int4_avx2.cpp`).

On x86 CPUs with AVX2 but not AVX-512, torch's packed int4 kernel is
compute-bound (slower than float32 from a few rows: docs/speed.md) and
Inductor's int4 templates need AVX-512. This kernel decodes 8 weights with two
shifts and a conversion and reads each 32 weights once for up to 4 rows. It
computes the same values as torch's kernel for the same bfloat16 scales and
offsets: `q * s + z` per weight, bfloat16 activations, float32 sums, a
bfloat16 output (up to the order of the float32 sums).

`pack` lays out a weight (from the same padded, spread values as torch's
layout, `int4.Int4Layout`) with plain tensor ops, so that a frozen compiled
graph folds it into constants; `int4_mm` runs the product, eagerly through
`ctypes` and under compilers as the custom op
`torch.ops.dtype_policies.int4_mm_avx2`; `decoded_mm` decodes the weight chunk by
chunk into float32 for GEMMs, for many rows, where float32 GEMMs beat any int4
kernel on this class (eager only).

>>> import torch
>>> from dtype_policies.quantization.kernels import int4_native
>>> q = torch.randint(-8, 8, (16, 64), dtype=torch.int32)
>>> scale = torch.full((1, 16), 0.5).bfloat16()
>>> offset = torch.zeros(1, 16).bfloat16()
>>> packed, pairs = int4_native.pack(q, scale, offset, group=64)
>>> packed.shape, pairs.shape, pairs.dtype
(torch.Size([16, 32]), torch.Size([16, 1, 2]), torch.bfloat16)
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies.quantization.kernels import native

KERNEL = "int4_avx2"
# below this many weights one thread does the whole product (a parallel region
# costs more than it saves)
_PARALLEL_MIN_WEIGHTS = 1 << 16


def available() -> bool:
    """Whether the kernel runs on this processor (and could be built)."""
    return native.available(KERNEL)


def padded_k(k: int) -> int:
    """The kernel's K: a multiple of 64."""
    return -(-k // 64) * 64


def pack(
    q_nk: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weight (N, Kp / 2) uint8 and its (N, Kp / group, 2)
    bfloat16 (scale, offset) pairs, from signed int4 values `q_nk` (N, K) in
    [-8, 7] and bfloat16 `scale`, `offset` (K / group, N); `group` a power of
    two from 32, dividing K. Inputs past K (to a multiple of 64) get zero weights."""
    n, k = q_nk.shape
    kp = padded_k(k)
    groups = -(-kp // group)
    # Only ops on the stored values and Python scalars (no tensor constructors),
    # so that a frozen graph folds the whole packing into a constant.
    blocks = (F.pad(q_nk.to(torch.int32), (0, kp - k)) & 0xF).view(n, kp // 64, 8, 8)
    words = blocks[:, :, 0, :]  # nibble i of word j of each 64 inputs: input 8 i + j
    for i in range(1, 8):
        words = words | (blocks[:, :, i, :] << (4 * i))
    packed = words.contiguous().view(torch.uint8).view(n, kp // 2)
    pairs = torch.stack([scale, offset], dim=-1).transpose(0, 1)  # (N, G, 2)
    if pairs.shape[1] != groups:
        pairs = F.pad(pairs, (0, 0, 0, groups - pairs.shape[1]))
    return packed, pairs.contiguous()


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int
) -> torch.Tensor:
    """`x` (M, K) bfloat16 times the packed weight: (M, n) bfloat16."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return torch.ops.dtype_policies.int4_mm_avx2(x, packed, pairs, group, n)
    return _run(x, packed, pairs, group, n)


def _threads(weights: int) -> int:
    """torch's intra-op threads, or one for a product too small to share."""
    return torch.get_num_threads() if weights >= _PARALLEL_MIN_WEIGHTS else 1


def _run(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int):
    x = x.contiguous()
    m, k = x.shape
    kp = packed.shape[1] * 2
    y = torch.empty((m, n), dtype=torch.bfloat16)
    threads = _threads(n * kp)
    status = _function()(
        x.data_ptr(), m, k, packed.data_ptr(), pairs.data_ptr(), kp, group, y.data_ptr(), n, threads
    )
    if status != 0:
        raise RuntimeError(
            f"int4_avx2 kernel rejected its arguments (status {status}): K={k}, Kp={kp}, "
            f"group={group}; expected Kp a multiple of 64, group a power of two from 32, K <= Kp"
        )
    return y


def decode(
    packed: torch.Tensor, pairs: torch.Tensor, group: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 (N, Kp) weight of packed rows: `q * s + z` per weight,
    written into `out` when given (a float32 (N, Kp) tensor)."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((n, kp), dtype=torch.float32) if out is None else out
    threads = _threads(n * kp)
    status = _function("dtype_policies_int4_dequantize")(
        packed.data_ptr(), pairs.data_ptr(), kp, group, n, out.data_ptr(), threads
    )
    if status != 0:
        raise RuntimeError(
            f"int4_avx2 decoding rejected its arguments (status {status}): Kp={kp}, "
            f"group={group}; expected Kp a multiple of 64, group a power of two from 32"
        )
    return out


# decoded weights are produced this many float32 values at a time (1 MiB: the
# chunk is multiplied while it is still in cache)
_DECODED_CHUNK_VALUES = 1 << 18


def decoded_mm(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int
) -> torch.Tensor:
    """`x` (M, K) float32 times the packed weight, decoded chunk by chunk of
    output rows into one cache-sized buffer, each chunk one float32 GEMM:
    (M, N) float32."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    k = x.shape[1]
    rows = max(16, _DECODED_CHUNK_VALUES // kp)
    if rows >= n:
        return F.linear(x, decode(packed, pairs, group)[:, :k])
    buffer = torch.empty((rows, kp), dtype=torch.float32)
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        weight = decode(packed[start:stop], pairs[start:stop], group, buffer[: stop - start])
        y[:, start:stop] = F.linear(x, weight[:, :k])
    return y


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "dtype_policies_int4_mm_bf16": [
        _PTR,
        _I64,
        _I64,
        _PTR,
        _PTR,
        _I64,
        _I64,
        _PTR,
        _I64,
        ctypes.c_int,
    ],
    "dtype_policies_int4_dequantize": [_PTR, _PTR, _I64, _I64, _I64, _PTR, ctypes.c_int],
}
_FUNCTIONS: dict[str, Any] = {}


def _function(name: str = "dtype_policies_int4_mm_bf16") -> Any:
    function = _FUNCTIONS.get(name)
    if function is None:
        library = native.library(KERNEL)
        if library is None:
            raise RuntimeError("the int4_avx2 kernel is not available on this machine")
        function = getattr(library, name)
        function.argtypes = _SIGNATURES[name]
        function.restype = ctypes.c_int
        _FUNCTIONS[name] = function
    return function


# The operator for compiled graphs: defined on a plain `torch.library.Library`
# (a CPU kernel and a fake one), which Inductor calls through the dispatcher
# with less per-call work than a `torch.library.custom_op` wrapper (measured:
# about 45 µs less per product at one row).
_LIBRARY = torch.library.Library("dtype_policies", "FRAGMENT")
_LIBRARY.define("int4_mm_avx2(Tensor x, Tensor packed, Tensor pairs, int group, int n) -> Tensor")
_LIBRARY.impl("int4_mm_avx2", _run, "CPU")


@torch.library.register_fake("dtype_policies::int4_mm_avx2", lib=_LIBRARY)
def _(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int):
    return x.new_empty((x.shape[0], n), dtype=torch.bfloat16)
