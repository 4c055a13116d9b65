"""The int4 product on this library's AVX2 kernels (`_csrc/int4_avx2.cpp`,
operators in `_csrc/int4_ops.cpp`).

On x86 CPUs with AVX2 but not AVX-512, torch's packed int4 kernel is
compute-bound (slower than float32 from a few rows: docs/speed.md) and
Inductor's int4 templates need AVX-512. The weight-only kernel decodes 8
weights with two shifts and a conversion and reads each 32 weights once for up
to 4 rows. It computes torch's kernel's formula, `q * s + z` per weight,
bfloat16 activations, float32 sums, a bfloat16 output, with float32 scales
and offsets (torch's kernel takes them in bfloat16): each group's weights are
Keras's `(q - zero) * scale` up to float32 rounding, wherever the group lies.

The W4A8 kernel (`int4_mm_q8`, weights packed by `pack_q8`, 8 output
columns interleaved) first rounds the activations to int8 in blocks of 32
inputs (`epilogues.round_activation_blocks`), then multiplies 4 inputs by 8
columns per instruction in integers (no saturation without VNNI: the weights
are unsigned nibbles), the 8 columns' sums in the lanes of one register; it
computes the weight-only product of the rounded activations. It runs on every
x86 CPU with AVX2; on CPUs with AVX-512 VNNI as its copy `int4_mm_q8_vnni`
(`vpdpbusd`, 4 rows per weight load), and on AMX CPUs as `int4_mm_q8_amx`
(`_csrc/int4_amx.inc`: the nibbles expanded per call, a group of 4 panels of
16 columns at a time per thread, into int8 tiles, one `tdpbssd` per 16 rows x
16 columns x block of 32 inputs on the int8 kernel's AMX tile loop, then the
same float epilogue in the same order; from `Q8_AMX_MIN_ROWS` rows, its last
argument, the VNNI copy below), all three the same values bit for bit
(`q8_suffix`, `benchmarks/amx_int8.py --w4a8`: the AMX copy 1.2-1.8x the VNNI
copy at 32 rows, 1.6-2.1x at 128-512, still 0.3-0.55x a bfloat16 GEMM there,
bound by the per-block float epilogue the values require, as the int8 AMX
copy).

`pack` and `pack_q8` lay out a weight (from the same padded, spread values as
torch's layout, `int4.Int4Layout`) with plain tensor ops, so that a frozen
compiled graph folds them into constants; the products are the operators
`torch.ops.dtype_policies.int4_mm_avx2` and `int4_mm_q8_avx2`, eager and
compiled alike; `decoded_mm` (the operator `int4_decoded_mm`, eager and
compiled alike) decodes the weight chunk by chunk into float32 for GEMMs, for
many rows, where float32 GEMMs beat any int4 kernel on this class.

The same library decodes torch's own packing (`_convert_weight_to_int4pack_for_cpu`,
the layout of the CPUs with AVX-512) into bfloat16, chunk by chunk, each chunk
one bfloat16 GEMM: `packed_decoded_mm`, for many rows on CPUs whose bfloat16
GEMMs are native. Which of torch's layouts a process packs is found once by
packing a probe (`torch_packing_block`); a layout it does not know leaves the
path unused.

>>> import torch
>>> from dtype_policies.quantization.kernels import int4_native
>>> q = torch.randint(-8, 8, (16, 64), dtype=torch.int32)
>>> scale = torch.full((1, 16), 0.5)
>>> offset = torch.zeros(1, 16)
>>> packed, pairs = int4_native.pack(q, scale, offset, group=64)
>>> packed.shape, pairs.shape, pairs.dtype
(torch.Size([16, 32]), torch.Size([16, 1, 2]), torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies import _native as native
from dtype_policies._core.casting import float16_rounded
from dtype_policies._cpu import Processor, processor

KERNEL = "avx2"
# From this many rows the W4A8 product runs its AMX copy on AMX CPUs: 1.1-1.6x
# its VNNI copy at 16 rows, 1.2-2.0x at 32, 1.6-2.5x at 128-512; 0.7-0.96x at
# 8 (1 and 2 threads, 4 shapes: `benchmarks/amx_int8.py --w4a8`, docs/speed.md).
Q8_AMX_MIN_ROWS = 16


def available() -> bool:
    """Whether the weight-only kernel is this processor's choice: x86 with
    AVX2 but not AVX-512 (where torch's kernels win), and the library built."""
    return "avx512" not in processor().features and native.available(KERNEL)


def q8_available() -> bool:
    """Whether the W4A8 kernel runs here: any x86 CPU with AVX2 and FMA, the
    library built."""
    return native.available(KERNEL)


def padded_k(k: int) -> int:
    """The kernel's K: a multiple of 64."""
    return -(-k // 64) * 64


def pack(
    q_nk: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weight (N, Kp / 2) uint8 and its (N, Kp / group, 2)
    float32 (scale, offset) pairs, from signed int4 values `q_nk` (N, K) in
    [-8, 7] and `scale`, `offset` (K / group, N); `group` a power of two from
    32, dividing K. Inputs past K (to a multiple of 64) get zero weights."""
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
    return packed, _pairs(scale, offset, groups)


def pack_q8(
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group: int,
    half: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 kernel's weight (ceil(N / 8), Kp * 4) uint8 and its
    (ceil(N / 8), Kp / group, 16) scales and offsets, from the same
    arguments as `pack` (Kp: K rounded up to a multiple of 32). Output columns
    are interleaved by 8 (`_csrc/int4_avx2.cpp` has the byte order); padded
    columns and inputs get zero weights.

    The scales and offsets are float16 when `half`, float32 when not; `None`
    (eager only: it reads the values) takes float16 where `half_pairs_keep`
    says it keeps every weight. A decoding row reads each weight once from
    memory, so that the kernel's time follows its bytes: float16 pairs take
    a weight of group 32 from 0.75 to 0.625 bytes (docs/speed.md)."""
    n, k = q_nk.shape
    kp = -(-k // 32) * 32
    n8 = -(-n // 8)
    unsigned = F.pad(q_nk.to(torch.int32) + 8, (0, kp - k, 0, 8 * n8 - n), value=8)
    # [c8, c, b, j, t] -> [c8, b, j, c, t]: 4 inputs of 8 columns per 32 bytes
    tiles = unsigned.view(n8, 8, kp // 32, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (tiles[:, :, :4] | (tiles[:, :, 4:] << 4)).to(torch.uint8)
    groups = -(-kp // group)
    pairs = torch.stack([scale.float(), offset.float()], dim=1)  # (G, 2, N)
    pairs = F.pad(pairs, (0, 8 * n8 - n, 0, 0, 0, groups - pairs.shape[0]))
    pairs = pairs.view(groups, 2, n8, 8).permute(2, 0, 1, 3).reshape(n8, groups, 16)
    if half is None:
        half = half_pairs_keep(pairs)
    pairs = pairs.half() if half else pairs
    return packed.reshape(n8, kp * 4).contiguous(), pairs.contiguous()


# float16 pairs move no weight by more than this fraction of its group's step
HALF_PAIRS_TOLERANCE = 2.0**-6
# steps below this fraction of the weight's largest count as that fraction of it
HALF_PAIRS_STEP_FLOOR = 2.0**-10


def half_pairs_keep(pairs: torch.Tensor) -> bool:
    """Whether float16 keeps the W4A8 layout's float32 `pairs` (..., 16)
    (8 scales s, then 8 offsets z): every weight `(u - 8) s + z`, u in
    [0, 15], moves by at most `HALF_PAIRS_TOLERANCE` of its step s, so that
    float16's rounding stays far below the int4 grid's own (half a step) and
    the int8 rounding of the activations. A step below `HALF_PAIRS_STEP_FLOOR`
    of the weight's largest counts as that: a group of zeros (a pruned row,
    its step a quantizer's epsilon) or of values a thousand times smaller than
    the weight's largest moves by at most 2^-16 of that largest step. Groups
    far from zero (|z| above about 100 s) and scales beyond float16's range
    keep the weight on float32.

    >>> s = torch.full((1, 1, 8), 0.01)
    >>> half_pairs_keep(torch.cat([s, 3 * s], dim=-1))
    True
    >>> half_pairs_keep(torch.cat([s, 100 + s], dim=-1))  # a group centred at 100
    False
    >>> zeros = torch.cat([torch.full((1, 1, 8), 7e-9), torch.full((1, 1, 8), 5.6e-8)], -1)
    >>> half_pairs_keep(torch.cat([torch.cat([s, 3 * s], -1), zeros], 1))  # a pruned group
    True
    """
    return bool(_half_keeps(pairs[..., :8], pairs[..., 8:]))


def _half_keeps(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """`half_pairs_keep`'s test of steps `s` and offsets `z` (float32, any
    shapes alike), as a 0-dim bool tensor (traceable: no branch)."""
    step = s.abs()
    moved = 8 * (float16_rounded(step) - step).abs() + (float16_rounded(z) - z).abs()
    everything = tuple(range(step.dim()))  # by name: ONNX's exporter needs them
    floor = step.amax(everything) * HALF_PAIRS_STEP_FLOOR if step.numel() else step.new_zeros(())
    return (moved <= HALF_PAIRS_TOLERANCE * torch.maximum(step, floor)).all()


def q8_kernel_pairs(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 steps and offsets (any shapes alike) as the W4A8 kernel
    multiplies by them: rounded to float16 where `half_pairs_keep` holds for
    all of them, as `pack_q8` decides, in tensor ops (no branch on the
    values), so that traced and eager products of one weight agree.

    >>> s = torch.tensor([0.01, 0.3])
    >>> [t.tolist() == t.half().float().tolist() for t in q8_kernel_pairs(s, 3 * s)]
    [True, True]
    >>> q8_kernel_pairs(s, 100 + s)[0].tolist() == s.tolist()  # a group centred at 100
    True
    """
    s, z = scale.float(), offset.float()
    keep = _half_keeps(s, z)
    # float16's values by integer ops under torch.compile: Inductor skips the
    # rounding of a fused `.half().float()` (its traced products multiplied by
    # the float32 pairs)
    return torch.where(keep, float16_rounded(s), s), torch.where(keep, float16_rounded(z), z)


def _pairs(scale: torch.Tensor, offset: torch.Tensor, groups: int) -> torch.Tensor:
    """The (N, groups, 2) float32 (scale, offset) pairs of (G, N) grids."""
    pairs = torch.stack([scale.float(), offset.float()], dim=-1).transpose(0, 1)  # (N, G, 2)
    if pairs.shape[1] != groups:
        pairs = F.pad(pairs, (0, 0, 0, groups - pairs.shape[1]))
    return pairs.contiguous()


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int
) -> torch.Tensor:
    """`x` (M, K) bfloat16 times the packed weight: (M, n) bfloat16."""
    return _ops().int4_mm_avx2(x, packed, pairs, group, n)


def int4_mm_q8(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int
) -> torch.Tensor:
    """`x` (M, K) bfloat16, rounded to int8 in blocks of 32 inputs, times the
    weight packed by `pack_q8`: (M, n) bfloat16. The operator `q8_suffix`
    names for this processor (the AMX one picks its copy by rows; the same
    values bit for bit)."""
    suffix = q8_suffix()
    tiles_from = (Q8_AMX_MIN_ROWS,) if suffix == "amx" else ()  # the AMX operator's rows
    return getattr(_ops(), f"int4_mm_q8_{suffix}")(x, packed, pairs, group, n, *tiles_from)


def q8_suffix(cpu: Processor | None = None) -> str:
    """Which W4A8 operator runs on `cpu` (default this one): `"amx"` on AMX
    CPUs (its tiles from `Q8_AMX_MIN_ROWS` rows, its last argument, the VNNI
    copy below: chosen inside the operator, so a compiled graph with a
    dynamic number of rows holds no guard on it), else
    `native.operator_suffix`'s (`"vnni"` with AVX-512 VNNI, else `"avx2"`).

    >>> from dataclasses import replace
    >>> amx = replace(processor(), features=frozenset({"avx2", "avx512", "avx512_vnni", "amx"}))
    >>> q8_suffix(amx)
    'amx'
    >>> q8_suffix(replace(amx, features=frozenset({"avx2"})))
    'avx2'
    """
    cpu = processor() if cpu is None else cpu
    return "amx" if "amx" in cpu.features else native.operator_suffix(cpu)


def decode(
    packed: torch.Tensor,
    pairs: torch.Tensor,
    group: int,
    out: torch.Tensor | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """The float32 (N, Kp) weight of packed rows (`pack`'s layout, or
    `pack_q8`'s with `q8`, N then a multiple of 8): `q * s + z` per weight,
    written into `out` when given (a float32 (N, Kp) tensor)."""
    n, kp = _shape(packed, q8)
    out = torch.empty((n, kp), dtype=torch.float32) if out is None else out
    if q8:
        _ops().int4_decode_q8_avx2(packed, pairs, group, out)
    else:
        _ops().int4_decode_avx2(packed, pairs, group, out)
    return out


def _shape(packed: torch.Tensor, q8: bool) -> tuple[int, int]:
    """(N, Kp) of a packed weight (W4A8: N rounded up to a multiple of 8)."""
    if q8:
        return packed.shape[0] * 8, packed.shape[1] // 4
    return packed.shape[0], packed.shape[1] * 2


def decoded_mm(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, q8: bool = False
) -> torch.Tensor:
    """`x` (M, K) float32 times the packed weight, decoded chunk by chunk of
    output rows (1 MiB of float32 at a time) into one cache-sized buffer,
    each chunk one float32 GEMM: (M, N) float32 (W4A8: N rounded up to a
    multiple of 8). One operator, eager and compiled alike."""
    return _ops().int4_decoded_mm(x, packed, pairs, group, q8)


_torch_block: list[int | None] = []  # found once per process (`torch_packing_block`)


def torch_packing_block() -> int | None:
    """The column block of torch's CPU int4 packing in this process (64 where
    its kernels run AVX-512, 32 under AVX2), found by decoding a packed probe;
    None where this library's decoder does not read it (or is not built)."""
    if not native.available(KERNEL):  # on this processor (or the class emulated)
        return None
    if not _torch_block:  # torch's packing: one layout per process
        _torch_block.append(_probe_torch_block())
    return _torch_block[0]


def _probe_torch_block() -> int | None:
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return None
    with torch.inference_mode(False), torch.no_grad():
        q = torch.randint(0, 16, (112, 64), generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        ones = torch.ones(1, 112, dtype=torch.bfloat16)
        pairs = torch.stack([ones, torch.zeros_like(ones)], dim=-1).contiguous()  # s 1, z 0
        identity = torch.eye(64, dtype=torch.bfloat16)
        for block in (64, 32):
            try:
                decoded = _ops().int4_packed_decoded_mm(identity, packed, pairs, 64, block)
            except RuntimeError:
                continue
            if torch.equal(decoded.float(), (q - 8).t().float()):
                return block
    return None


def packed_decoded_mm(
    x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int
) -> torch.Tensor:
    """`x` (M, Kp) bfloat16 times torch's packed int4 weight (`pairs`: its
    (Kp / group, Np, 2) bfloat16 scales and offsets), decoded chunk by chunk
    into bfloat16, each chunk one GEMM with float32 sums: (M, Np) bfloat16.
    Needs `torch_packing_block()`."""
    block = torch_packing_block()
    if block is None:
        raise RuntimeError("torch's int4 packing is not one this library decodes in this process")
    return _ops().int4_packed_decoded_mm(x, packed, pairs, group, block)


def _ops() -> Any:
    """The operators' namespace, the library built and loaded if it was not."""
    if native.library(KERNEL) is None:
        raise RuntimeError(
            "the int4 AVX2 kernels are not available on this machine (see the warning "
            "of their build)"
        )
    return torch.ops.dtype_policies


def _product_fake(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int, n: int,
                  min_rows: int = 0):  # fmt: skip
    return x.new_empty((x.shape[0], n), dtype=torch.bfloat16)


def _decode_fake(packed: torch.Tensor, pairs: torch.Tensor, group: int, out: torch.Tensor) -> None:
    return None


def _decoded_fake(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int,
                  q8: bool):  # fmt: skip
    n = packed.shape[0] * 8 if q8 else packed.shape[0]
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def _packed_decoded_fake(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group: int,
                         block: int):  # fmt: skip
    return x.new_empty((x.shape[0], pairs.shape[1]), dtype=torch.bfloat16)


# shapes for compilers (the operators come from the built library)
native.register_fakes(
    KERNEL,
    {
        **{
            f"dtype_policies::{name}": _product_fake
            for name in ("int4_mm_avx2", "int4_mm_q8_avx2", "int4_mm_q8_vnni", "int4_mm_q8_amx")
        },
        **{
            f"dtype_policies::{name}": _decode_fake
            for name in ("int4_decode_avx2", "int4_decode_q8_avx2")
        },
        "dtype_policies::int4_decoded_mm": _decoded_fake,
        "dtype_policies::int4_packed_decoded_mm": _packed_decoded_fake,
    },
)
