"""int4 (weight-only) products, on the path chosen per weight (`int4_path`).

Which CPU kernel a weight is packed for is decided once per weight from the
processor (`cpu_kernel`): on x86 CPUs with AVX2 but not AVX-512 this
library's own kernel (`int4_native`: torch's AVX2 int4 kernel is
compute-bound there and Inductor has no AVX2 int4 template), from 128 rows its
weight decoded per call into float32 GEMMs; elsewhere torch's, from 64 rows
(32 for weights of 2^20 elements or more) its weight decoded per call into
bfloat16 GEMMs where bfloat16 products are native (`decoded_min_rows`). The kernels compute the
same formula (below) from the same layout plan (`Int4Layout`); the bfloat16
GEMMs round each weight `q * s + z` to bfloat16 first (a relative 2**-9 per
weight, below the output's own rounding to bfloat16 in a sum of many terms).

On CPU every shape can run on torch's packed kernel
`_weight_int4pack_mm_for_cpu`, with bfloat16 activations, scales and offsets
whatever the compute dtype: its float32 and float16 variants are scalar code,
50-100x slower (measured, torch 2.13, AVX2 and AVX-512). This library's
kernels (`int4_native`) take float32 scales and offsets with bfloat16
activations. From a float32 or float16 source the activations and the
outputs are rounded to bfloat16 around the kernel (a relative 2**-9, small
against int4's own error); outputs come back in the compute dtype. The weight
is laid out once (`Int4Layout`):

* the kernel's group (32, 64, 128 or 256 values along K sharing a scale and
  an offset) is the largest that divides both the block and K, so that a block
  that does not divide K (K = 576, block 128) maps exactly onto smaller kernel
  groups with repeated scales (64 here);
* where no kernel group fits (a block or a per-channel K that is not a
  multiple of 32), each block is padded to a multiple of 32 with zero weights
  and the activations are spread over the padded positions on each call (a
  copy of the activations, not of the weight);
* N is padded to a multiple of 16 with zero rows and the output sliced;
* a `g_idx` that permutes the groups (GPTQ's activation order) is folded in:
  the columns are packed sorted by group (each block contiguous again) and
  the activations gathered into that order on each call (with the spread
  above, one scatter does both).

Grouped weights are `(q - zero) * scale` along the input axis (the kernels
compute `(u - 8) * s + z` with `u = q + 8` and `z = -zero * s`, so `zero`
may be any real value); per-channel weights are `q / scale`. With float32
`s` and `z` (this library's kernels, and the plain ops of `kernel_weight`)
that is Keras's weight up to float32 rounding: a weight of exactly 0 is 0
but for the float32 rounding of its group's offset, and a group centred far
from 0 keeps its own quantization error. torch's kernel rounds `s` and `z` to
bfloat16: a relative 2**-9 of each group's offset, which exceeds int4's own
error for groups far from 0. Per-channel
weights of fewer than `DEQUANTIZED_MAX_ELEMENTS` elements at
`DEQUANTIZED_MIN_ROWS` rows or more run as one GEMM on their integer values
cast per call, scaled after, on CPUs with AMX and oneDNN's bfloat16 (faster
there: its bfloat16 tiles outrun the kernel; `dequantized_min_rows`).
Elsewhere (other devices): dequantize and multiply in the compute dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from dtype_policies._compat import compiling
from dtype_policies._core.casting import (
    as_product_input,
    bfloat16_rounded,
    float32_values,
    plus_bias,
    straight_through,
)
from dtype_policies._core.products import product_dtype
from dtype_policies._cpu import Processor, processor
from dtype_policies.quantization.kernels import (
    epilogues,
    freezing_weights,
    int4_native,
    tensor_key,
)
from dtype_policies.quantizers.math import dequantize_grouped

KERNEL_GROUPS = (256, 128, 64, 32)
_KERNEL_AVAILABLE = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

# Inductor's `inductor_force_stride_order` prim, looked up by `kernels.prepare`
# before a compiled call traces a product (importing Inductor's prims registers
# it); `None` until then or without Inductor.
_force_stride_order: Any = None


def find_inductor_prims() -> None:
    """Looks up Inductor's stride prim for `_row_major` (once; a no-op without Inductor)."""
    global _force_stride_order
    if _force_stride_order is None:
        with contextlib.suppress(ImportError):
            import torch._inductor.inductor_prims  # registers the prim
        _force_stride_order = getattr(torch.ops.prims, "inductor_force_stride_order", None)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """`x` contiguous, also in a graph Inductor compiles: its lowering of
    torch's int4 product lets the producer choose the input's strides, and a
    column-major buffer (after a fused RMSNorm, at 24 rows on an `amx` CPU)
    crashed the kernel ("expect A to be contiguous")."""
    x = x.contiguous()
    if _force_stride_order is not None and compiling():
        strides = x.stride()
        if not any(isinstance(stride, torch.SymInt) for stride in strides):  # its ints only
            x = _force_stride_order(x, strides)
    return x


def dequantize_int4(
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 (N, K) weight of int4 values `q_nk` with Keras's scales:
    grouped `scale`/`zero` of shape (G, N) (input `k` in group `g_idx[k]`,
    default `k // block_size`), or per-channel `scale` (N,)."""
    if block_size > 0:
        return dequantize_grouped(q_nk.t(), scale, zero, block_size, g_idx).t()
    return q_nk.float() / scale.float()[:, None]


def kernel_weight(
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    g_idx: torch.Tensor | None = None,
    bfloat16_pairs: bool = False,
    q8_pairs: bool = False,
) -> torch.Tensor:
    """The float32 (N, K) weight a kernel multiplies by: `q * s + z` with the
    scale `s` and offset `z = -zero * s` (per channel: `q * (1 / scale)`), in
    float32 as this library's kernels take them (Keras's `(q - zero) *
    scale` up to float32 rounding), or with `bfloat16_pairs` as torch's kernel
    takes them (`s` rounded to bfloat16, then `z` from it), or with
    `q8_pairs` as the W4A8 kernel takes them (`int4_native.q8_kernel_pairs`:
    float16 where that keeps every weight). Plain ops, for compilers and
    tracers, so that they compute what the eager kernel computes
    (`torch_kernel_here`, `w4a8_kernel_here`)."""
    if block_size <= 0:  # per channel: steps only (W4A8 is grouped)
        step = 1.0 / scale.float()
        return q_nk.float() * (bfloat16_rounded(step) if bfloat16_pairs else step)[:, None]
    assert zero is not None  # grouped grids have zero points
    if g_idx is None:
        block = torch.arange(q_nk.shape[1], device=q_nk.device) // block_size
    else:
        block = g_idx.long()
    if q8_pairs:  # each group's pair rounded, then spread over its inputs
        steps = scale.float()
        steps, offsets = int4_native.q8_kernel_pairs(steps, -zero.float() * steps)
        return q_nk.float() * steps[block].t() + offsets[block].t()
    group_scale = scale.float()[block].t()  # (N, K)
    if bfloat16_pairs:
        group_scale = bfloat16_rounded(group_scale)
        return q_nk.float() * group_scale + bfloat16_rounded(-zero.float()[block].t() * group_scale)
    return q_nk.float() * group_scale - zero.float()[block].t() * group_scale


def w4a8_kernel_here(activation_block_size: int | None) -> bool:
    """Whether this processor's eager W4A8 products run on the W4A8 kernel,
    whose scales and offsets may be float16: the traced ones then compute
    with those (`kernel_weight`'s `q8_pairs`)."""
    return activation_block_size is not None and cpu_kernel(activation_block_size) == "native_q8"


def torch_kernel_here(activation_block_size: int | None = None) -> bool:
    """Whether this processor's eager products of an int4 weight run on
    torch's kernel (`cpu_kernel`), whose scales and offsets are bfloat16:
    the traced products then compute with those (`kernel_weight`)."""
    return cpu_kernel(activation_block_size) == "packed"


def int4_linear_traceable(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    activation_block_size: int | None = None,
) -> torch.Tensor:
    """The product as the CPU kernels compute it, in plain ops: bfloat16
    activations (rounded in blocks with `activation_block_size`) times the
    kernel's float32 `weight`, a bfloat16 output."""
    if activation_block_size is None:
        xk = bfloat16_rounded(x2)
    else:
        xk = straight_through(
            x2.float(), epilogues.round_activation_blocks(x2, activation_block_size)
        )
    y = bfloat16_rounded(F.linear(xk, weight)).to(out_dtype)  # the kernel's bfloat16 output
    return plus_bias(y, bias)


def int4_linear_traced(
    x2: torch.Tensor,
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    runtime: Int4Runtime | None,
    g_idx: torch.Tensor | None = None,
    activation_block_size: int | None = None,
) -> torch.Tensor:
    """The product for compilers and tracers (`runtime`: `None` when the
    graph records gradients).

    With frozen weights (`freezing_weights`), where the eager runtime's plan
    (made by an earlier eager call on the same stored tensors: a frozen graph
    is never run after they change) says the packed kernel applies, the graph
    packs the weight itself, which freezing folds into a constant once, and
    calls the kernel: the storage stays int4 and the values are the eager
    ones. The plan is read only for what cannot be traced (whether `g_idx`
    permutes the blocks, and the path for the rows); the packing is computed
    from the stored tensors. The decoded paths are one operator each, and
    run in a graph as in eager.
    Otherwise plain ops on the kernel's float32 weight (`kernel_weight`, with
    torch's kernel's bfloat16 scales and offsets where that kernel runs),
    computing what the kernel computes.
    """
    plan = None if runtime is None or not freezing_weights() else runtime.plan
    path = None if plan is None else _path(plan, x2.shape[0], block_size)
    if plan is not None and path in KERNELS:
        order = None
        if plan.permuted:  # a permuting g_idx was given to the plan
            assert g_idx is not None
            order = torch.argsort(g_idx.long(), stable=True)
        traced = _pack(q_nk, scale, zero, block_size, order, plan.kernel, plan.half_pairs)
        return _packed(x2, traced, plan.n, bias, out_dtype, decoded=path.startswith("decoded"))
    bfloat16_pairs = torch_kernel_here(activation_block_size)
    q8_pairs = w4a8_kernel_here(activation_block_size)
    weight = kernel_weight(q_nk, scale, zero, block_size, g_idx, bfloat16_pairs, q8_pairs)
    return int4_linear_traceable(x2, weight, bias, out_dtype, activation_block_size)


@dataclass(frozen=True)
class Int4Layout:
    """Where the packed kernel reads each input position.

    Attributes:
        group: The kernel's group size.
        padded_k: K of the packed weight (a multiple of `group`).
        stride: Padded length of one block (`block_size`, or per channel K,
            rounded up to a multiple of 32 when it is not one).
        spread: Whether each block is padded (the activations are spread over
            `padded_k` positions per call); otherwise only the tail is.
    """

    group: int
    padded_k: int
    stride: int
    spread: bool

    @staticmethod
    def plan(k: int, block_size: int) -> Int4Layout:
        """The layout for K inputs in blocks of `block_size` (<= 0: per channel)."""
        block = block_size if block_size > 0 else k
        common = math.gcd(block, k)
        if common % 32 == 0:  # exact: kernel groups inside blocks, no padding
            group = next(g for g in KERNEL_GROUPS if common % g == 0)
            return Int4Layout(group, k, block, False)
        stride = -(-block // 32) * 32
        group = next(g for g in KERNEL_GROUPS if stride % g == 0)
        blocks = -(-k // block)
        last = k - (blocks - 1) * block
        padded_k = (blocks - 1) * stride + -(-last // group) * group
        return Int4Layout(group, padded_k, stride, stride != block and blocks > 1)

    def positions(self, k: int, block_size: int) -> torch.Tensor:
        """The padded position of each of the K inputs."""
        block = block_size if block_size > 0 else k
        j = torch.arange(k)
        return (j // block) * self.stride + j % block

    def block_of_groups(self) -> torch.Tensor:
        """The block each kernel group reads its scale from."""
        return torch.arange(self.padded_k // self.group) * self.group // self.stride


@dataclass(frozen=True)
class Int4Packed:
    """One weight packed for the CPU kernel: immutable, replaced whole."""

    layout: Int4Layout
    packed: torch.Tensor
    n: int
    positions: torch.Tensor | None  # set when activations are spread (or permuted and spread)
    order: torch.Tensor | None  # the inputs in kernel order, when g_idx permutes them
    # (scale, offset) per kernel group: torch's packing bfloat16 (padded_k / group,
    # padded N, 2); this library's float32 (W4A8: float16 where `pack_q8` finds it
    # keeps them), in `int4_native`'s layouts
    scales_and_zeros: torch.Tensor
    permuted: bool = False  # g_idx permutes the inputs (folded into `order` or `positions`)
    # "packed": torch's layout and kernel; "native" / "native_q8": `int4_native`'s
    # weight-only / W4A8 layout and kernel
    kernel: str = "packed"
    # W4A8: whether the pairs are float16, decided on the stored values (eager) and
    # repeated by a traced packing of the same values
    half_pairs: bool = False


class Int4Runtime:
    """The CPU int4 kernel's packed weight and scale/offset tensors, rebuilt
    when the stored tensors change; `packed` is `None` where the kernel does
    not apply (other devices, a `g_idx` that is not `arange(K) // block`).
    A `g_idx` that permutes `arange(K) // block` is folded into the plan
    (the kernel still applies). The key and the plan are published together
    as one immutable pair, so a thread reading while another refreshes sees
    one whole plan or the other."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: tuple[tuple, Int4Packed | None] | None = None

    @property
    def plan(self) -> Int4Packed | None:
        """The current packed plan (read once per product)."""
        state = self._state
        return None if state is None else state[1]

    @property
    def packed(self) -> torch.Tensor | None:
        plan = self.plan
        return None if plan is None else plan.packed

    @property
    def group_size(self) -> int:
        plan = self.plan
        return 0 if plan is None else plan.layout.group

    @property
    def layout(self) -> Int4Layout | None:
        plan = self.plan
        return None if plan is None else plan.layout

    def needs_refresh(self, stored: tuple[torch.Tensor, ...]) -> bool:
        """Whether the `stored` tensors (the module's own buffers, never views
        made per call) or the processor changed since the last `refresh`."""
        return self.stale_key(stored) is not None

    def stale_key(self, stored: tuple[torch.Tensor, ...]) -> tuple | None:
        """The key of the `stored` tensors on this processor when the packed
        data is not theirs, else None. Taken before their values are read
        and given to `refresh`: a write in between then makes the next call
        refresh again, where a key taken after the read would file the old
        values under the new key."""
        key = (*tensor_key(*stored), processor())
        state = self._state
        return None if state is not None and state[0] == key else key

    def current(
        self,
        stored: tuple[torch.Tensor, ...],
        read: Callable[
            [], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        ],
        block_size: int,
        activation_block_size: int | None = None,
    ) -> torch.Tensor | None:
        """Makes the plan that of the `stored` tensors where it is stale,
        from what `read()` returns after the key is taken: their (N, K)
        integer values, scale, zero and `g_idx` (a load that replaces the
        tensors meanwhile files a mixed plan under the old key, refreshed at
        the next call). Returns the integer values when this call read them,
        else None."""
        key = self.stale_key(stored)
        if key is None:
            return None
        q_nk, scale, zero, g_idx = read()
        self.refresh(
            q_nk,
            scale,
            zero,
            block_size,
            stored,
            g_idx,
            activation_block_size=activation_block_size,
            key=key,
        )
        return q_nk

    def refresh(
        self,
        q_nk: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        block_size: int,
        stored: tuple[torch.Tensor, ...],
        g_idx: torch.Tensor | None = None,
        kernel: str | None = None,
        activation_block_size: int | None = None,
        key: tuple | None = None,
    ) -> None:
        """Rebuilds the packed data from the (N, K) int values `q_nk` of the
        `stored` tensors, input `k` in group `g_idx[k]` (`None`: `k //
        block_size`). A `g_idx` that is not a permutation of `arange(K) //
        block_size` runs on the dequantized path (no plan), as does W4A8
        (`activation_block_size`) where its kernel does not run or `g_idx`
        permutes the inputs. `kernel` (a key of `KERNELS`) overrides this
        processor's choice (`cpu_kernel`), for comparisons; `key`: the
        `stale_key` taken before `q_nk` was read."""
        key = (*tensor_key(*stored), processor()) if key is None else key
        plan = None
        on_cpu = scale.device.type == "cpu"
        kernel = (kernel or cpu_kernel(activation_block_size)) if on_cpu else None
        if kernel is not None:
            with torch.inference_mode(False), torch.no_grad():
                order = _kernel_order(g_idx, q_nk.shape[1], block_size)
                if order is not False and not (kernel == "native_q8" and order is not None):
                    plan = _pack(q_nk, scale, zero, block_size, order, kernel)
        self._state = (key, plan)


def cpu_kernel(activation_block_size: int | None = None) -> str | None:
    """The CPU kernel int4 weights are packed for here (a key of `KERNELS`):
    this library's AVX2 kernel where it applies (`int4_native.available`),
    else torch's; None without either. W4A8 (`activation_block_size`): the
    W4A8 kernel on any x86 CPU with AVX2, else None (the dequantized path)."""
    if activation_block_size is not None:
        return "native_q8" if int4_native.q8_available() else None
    if int4_native.available():
        return "native"
    return "packed" if _KERNEL_AVAILABLE else None


def _kernel_order(
    g_idx: torch.Tensor | None, k: int, block_size: int
) -> torch.Tensor | Literal[False] | None:
    """The inputs sorted by group (`None` if already in order), or `False`
    when `g_idx` does not give each block `block_size` inputs."""
    if g_idx is None or block_size <= 0:
        return None
    if natural_groups(g_idx, k, block_size):
        return None
    groups = g_idx.long()
    order = torch.argsort(groups, stable=True)
    natural = torch.arange(k, device=g_idx.device) // block_size
    return order if torch.equal(groups[order], natural) else False


def natural_groups(g_idx: torch.Tensor, k: int, block_size: int) -> bool:
    """Whether `g_idx` gives each run of `block_size` inputs its own group, in
    order (`arange(k) // block_size`: int4's own grouping)."""
    natural = torch.arange(k, device=g_idx.device) // block_size
    return torch.equal(g_idx.long(), natural)


def _pack(
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    order: torch.Tensor | None = None,
    kernel: str = "packed",
    half_pairs: bool | None = None,
) -> Int4Packed:
    """The packed plan. Every weight-side op takes a stored tensor as input
    (no constructors), so that a frozen graph folds all of it into constants;
    `half_pairs` (W4A8): the plan's choice, `None` to decide from the values
    (eager only)."""
    n, k = q_nk.shape
    layout = Int4Layout.plan(k, block_size)
    padded_n = -(-n // 16) * 16
    if order is not None:
        q_nk = q_nk[:, order]
    unsigned = _spread(q_nk.to(torch.int32) + 8, k, block_size, layout)  # padding: 8, a zero
    groups = layout.padded_k // layout.group
    if block_size > 0:
        # each block's scale repeated over the kernel groups of its (padded) block
        per_block = layout.stride // layout.group
        assert zero is not None  # grouped grids have zero points
        group_scale = scale.float().repeat_interleave(per_block, dim=0)[:groups]
        zeros = zero.float().repeat_interleave(per_block, dim=0)[:groups]
    else:
        group_scale = (1.0 / scale.float())[None, :].expand(groups, n)
        zeros = torch.zeros_like(group_scale)
    offset = -zeros * group_scale  # float32: (u - 8) * s + z is (q - zero) * s
    if kernel == "native":
        packed, pair = int4_native.pack(unsigned - 8, group_scale, offset, layout.group)
    elif kernel == "native_q8":
        packed, pair = int4_native.pack_q8(
            unsigned - 8, group_scale, offset, layout.group, half_pairs
        )
    else:
        if padded_n != n:
            unsigned = F.pad(unsigned, (0, 0, 0, padded_n - n), value=8)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.contiguous(), 1)
        # torch's kernel takes bfloat16 scales and offsets; the offset comes
        # from the rounded scale, so that (u - 8) * s + z departs from
        # (q - zero) * s only by the offset's own rounding
        scale_bf16 = group_scale.bfloat16()
        offset_bf16 = (-zeros * scale_bf16.float()).bfloat16()
        if padded_n != n:  # padded before the stack: a graph's last op on them is a
            # concatenation, a buffer Inductor's lowering of torch's product takes (a pad
            # of it was left unrealized: a LoweringException for per-channel weights)
            scale_bf16 = F.pad(scale_bf16, (0, padded_n - n))
            offset_bf16 = F.pad(offset_bf16, (0, padded_n - n))
        pair = torch.stack([scale_bf16, offset_bf16], dim=-1)
    permuted = order is not None
    positions = layout.positions(k, block_size) if layout.spread else None
    if order is not None and positions is not None:  # input order[j] goes to positions[j]
        positions = torch.empty_like(positions).index_copy_(0, order, positions)
        order = None
    half = pair.dtype == torch.float16
    return Int4Packed(
        layout, packed, n, positions, order, pair.contiguous(), permuted, kernel, half
    )


def _spread(unsigned: torch.Tensor, k: int, block_size: int, layout: Int4Layout) -> torch.Tensor:
    """The (N, K) values at their padded positions (`Int4Layout.positions`),
    8 (a zero weight) elsewhere: shape ops and padding only."""
    n = unsigned.shape[0]
    if not layout.spread:
        return F.pad(unsigned, (0, layout.padded_k - k), value=8)
    block = block_size if block_size > 0 else k
    blocks = -(-k // block)
    rows = F.pad(unsigned, (0, blocks * block - k), value=8).view(n, blocks, block)
    rows = F.pad(rows, (0, layout.stride - block), value=8)
    return rows.reshape(n, blocks * layout.stride)[:, : layout.padded_k]


# Per-channel weights from this many rows: the weight's integer values cast
# per call and one GEMM in the product dtype beat the packed kernel, which is
# compute-bound (1 thread: 2-4x at 128 rows, 576 x 1536 and 576 x 192, AMX
# class). Grouped weights keep the kernel: their per-call dequantization
# (a scale and an offset per group) costs more than it saves.
DEQUANTIZED_MIN_ROWS = 32
# ... for weights of fewer elements than this: per-call unpacking is several
# slow elementwise passes (2048 x 5632: 10x slower than the kernel, measured).
DEQUANTIZED_MAX_ELEMENTS = 1 << 20
# ... and only with AMX: elsewhere the GEMM does not repay the unpacking (128
# rows, unpacking included, the kernel faster: natively on AMD Zen 4, bfloat16
# products native but no AMX, 2.9-3.4x at 384 x 1536, 576 x 1536 and 576 x 192,
# 2 threads; avx512 without bfloat16, 2.3-2.6x at 576 x 1536, 768 x 3072 and
# 896 x 4864, 6-8x at 32 rows; avx2, 1 thread, 1.0-1.4x).


def dequantized_min_rows(elements: int, cpu: Processor | None = None) -> int | None:
    """The rows from which a per-channel int4 weight of `elements` elements runs
    as one GEMM on its integer values cast per call (on CPUs with AMX whose
    bfloat16 products oneDNN runs natively), or None where it never does (the
    packed kernel at every row count)."""
    cpu = processor() if cpu is None else cpu
    if elements >= DEQUANTIZED_MAX_ELEMENTS or not (cpu.amx and cpu.native_bf16):
        return None
    return DEQUANTIZED_MIN_ROWS


KERNELS = {
    "packed": "torch's packed int4 kernel, bfloat16 activations",
    "decoded_bf16": "torch's packed weight decoded per call in cache-sized chunks into bfloat16, "
    "bfloat16 GEMMs",
    "native": "this library's AVX2 int4 kernel, bfloat16 activations",
    "decoded": "the AVX2 kernel's weight decoded per call in cache-sized chunks, float32 GEMMs",
    "native_q8": "this library's W4A8 kernel (AVX2, or its VNNI copy, or its AMX copy at many "
    "rows), activations rounded to int8 per 32 inputs",
    "decoded_q8": "the W4A8 kernel's weight decoded per call in chunks, float32 GEMMs on the "
    "rounded activations",
}
# The paths of each packing (the first: the kernel itself).
KERNEL_PATHS = {
    "packed": ("packed", "decoded_bf16"),
    "native": ("native", "decoded"),
    "native_q8": ("native_q8", "decoded_q8"),
}
# From this many rows a weight packed for the AVX2 kernel is decoded per call,
# a cache-sized chunk at a time, each chunk one float32 GEMM (bfloat16-rounded
# activations, as the kernel): the kernel reads each weight once per 4 rows, a
# GEMM far less often. Measured (AMD Zen 3, 2 threads, docs/speed.md): at 512
# rows 1.3-2x faster than the kernel at every measured shape, at 128 rows on
# three shapes of four, at 64 rows on none reliably. Not for the W4A8 kernel,
# whose integer products beat these GEMMs at every row count: its VNNI copy
# (4 rows per weight load, one vpdpbusd per 4 inputs x 8 columns) 3-5x at 128
# and 512 rows (AMD Zen 4), its AVX2 copy 1.5-2.8x at 128 rows (the shape
# sweep, 5 shapes) and 1.65-8.8x at 512 (AMD Zen 3, 2026-11-29, docs/speed.md).
NATIVE_DECODED_MIN_ROWS = 128
# From this many rows a weight packed for torch's kernel is decoded per call
# into bfloat16, 8 MiB of columns at a time, each chunk one bfloat16 GEMM, on
# CPUs whose bfloat16 products are native: torch's kernel dequantizes each
# weight once per 4 rows. Measured (AMD Zen 4, `avx512_bf16`, 2 threads,
# docs/speed.md), the kernel's time over the decoded path's: weights of 2^20
# elements and more 1.04-1.35x at 32 rows, 1.34-1.75x at 64; smaller ones
# (128 x 768 to 576 x 1536) 0.70-1.21x at 32 rows, 1.04-1.67x at 64; 512 rows
# within 1.1x of a bfloat16 weight's own GEMM.
PACKED_DECODED_MIN_ROWS = 64
PACKED_DECODED_LARGE_MIN_ROWS = 32
PACKED_DECODED_LARGE_ELEMENTS = 1 << 20
# Below this many rows every weight stays on its kernel (the fewest rows of
# any threshold above), so that one-row decoding asks nothing per call (eager;
# traced, the rows are compared with a weight's own thresholds only).
KERNEL_ONLY_BELOW_ROWS = min(
    DEQUANTIZED_MIN_ROWS,
    PACKED_DECODED_LARGE_MIN_ROWS,
    PACKED_DECODED_MIN_ROWS,
    NATIVE_DECODED_MIN_ROWS,
)
PATHS = {
    **KERNELS,
    "dequantized": "the weight dequantized per call, one GEMM",
}


def int4_path(runtime: Int4Runtime, rows: int, block_size: int) -> str:
    """The path (a key of `PATHS`) for `rows` rows."""
    return _path(runtime.plan, rows, block_size)


def paths(runtime: Int4Runtime) -> list[str]:
    """The paths `runtime`'s weight can run on (keys of `PATHS`)."""
    plan = runtime.plan
    if plan is None:
        return ["dequantized"]
    kernel_paths = list(KERNEL_PATHS[plan.kernel])
    if plan.kernel == "packed" and int4_native.torch_packing_block() is None:
        kernel_paths.remove("decoded_bf16")
    return [*kernel_paths, "dequantized"]


def _path(plan: Int4Packed | None, rows: int, block_size: int) -> str:
    if plan is None:
        return "dequantized"
    # Traced, rows are compared only with the thresholds that exist: in a
    # compiled graph with a dynamic number of rows each comparison is a guard.
    if not compiling() and rows < KERNEL_ONLY_BELOW_ROWS:
        return plan.kernel
    elements = plan.n * plan.layout.padded_k
    if block_size <= 0:
        from_rows = dequantized_min_rows(elements)
        if from_rows is not None and rows >= from_rows:
            return "dequantized"
    from_rows = decoded_min_rows(plan.kernel, elements=elements)
    if from_rows is not None and rows >= from_rows:
        return KERNEL_PATHS[plan.kernel][1]
    return plan.kernel


def decoded_min_rows(
    kernel: str, cpu: Processor | None = None, elements: int | None = None
) -> int | None:
    """The rows from which a weight of `elements` values (None: any weight)
    packed for `kernel` (a key of `KERNEL_PATHS`) is decoded per call on `cpu`
    (default this one), or None where it stays on its kernel. This library's
    weight-only AVX2 packing decodes into float32 GEMMs (the W4A8 kernel is
    faster than those GEMMs at any rows, in both copies); torch's packing decodes into
    bfloat16 GEMMs where bfloat16 products are native (elsewhere those GEMMs
    do not beat the kernel) and this library reads the packing.

    >>> from dtype_policies import _cpu
    >>> with _cpu.emulate("avx2"):
    ...     decoded_min_rows("packed") is None
    True
    """
    cpu = processor() if cpu is None else cpu
    if kernel == "packed":
        if not cpu.native_bf16 or int4_native.torch_packing_block() is None:
            return None
        if elements is not None and elements >= PACKED_DECODED_LARGE_ELEMENTS:
            return PACKED_DECODED_LARGE_MIN_ROWS
        return PACKED_DECODED_MIN_ROWS
    if kernel == "native_q8":
        return None
    return NATIVE_DECODED_MIN_ROWS


def int4_linear(
    x2: torch.Tensor,
    q_nk: torch.Tensor | None,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    runtime: Int4Runtime,
    path: str | None = None,
    g_idx: torch.Tensor | None = None,
    activation_block_size: int | None = None,
) -> torch.Tensor:
    """`x2 @ W.T + bias` for int4 weights `W` (grouped: `(q - zero) * scale`
    along the input axis, input `k` in group `g_idx[k]`; per channel:
    `q / scale`) on a 2-D `x2` (M, K), by `path` (default `int4_path`);
    with `activation_block_size`, of `x2` rounded by `epilogues.round_activation_blocks`
    (W4A8). `q_nk` (the int values, (N, K)) is needed by the dequantized path."""
    n = scale.shape[-1]
    if x2.shape[0] == 0:
        return x2.new_zeros((0, n), dtype=out_dtype)
    plan = runtime.plan
    if path is None:
        path = _path(plan, x2.shape[0], block_size)
    elif plan is not None and path in KERNELS and path not in paths(runtime):
        raise ValueError(
            f"int4 path {path!r} does not apply to a weight packed for {plan.kernel!r}; "
            f"its paths: {paths(runtime)}"
        )
    if plan is not None and path in KERNELS:
        return _packed(x2, plan, n, bias, out_dtype, decoded=path.startswith("decoded"))
    if q_nk is None:
        raise ValueError(f"int4 path {path!r} needs the weight's integer values (q_nk)")
    if activation_block_size is not None:  # W4A8 off its kernel: the same values
        q8_pairs = w4a8_kernel_here(activation_block_size)
        weight = kernel_weight(q_nk, scale, zero, block_size, g_idx, q8_pairs=q8_pairs)
        return int4_linear_traceable(x2, weight, bias, out_dtype, activation_block_size)
    dtype = product_dtype(x2.dtype, x2.device)
    if block_size > 0:
        weight = dequantize_int4(q_nk, scale, zero, block_size, g_idx).to(dtype)
        y = F.linear(as_product_input(x2, dtype), weight).to(out_dtype)
        return plus_bias(y, bias)
    y = F.linear(as_product_input(x2, dtype), q_nk.to(dtype))  # exact integer weights
    return epilogues.rescale(y, (1.0 / scale.float())[None, :], None, bias, out_dtype)


def _packed(
    x2: torch.Tensor,
    plan: Int4Packed,
    n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    decoded: bool = False,
) -> torch.Tensor:
    xk = x2 if x2.dtype is torch.bfloat16 else x2.bfloat16()
    layout = plan.layout
    if plan.order is not None:
        xk = xk.index_select(1, plan.order)
    if plan.positions is not None:
        spread = xk.new_zeros((xk.shape[0], layout.padded_k))
        xk = spread.index_copy_(1, plan.positions, xk)
    elif layout.padded_k != xk.shape[1]:
        xk = F.pad(xk, (0, layout.padded_k - xk.shape[1]))
    q8 = plan.kernel == "native_q8"
    # this library's operators: Inductor calls them, their outputs stored as
    # they return them (torch's int4 product has lowerings that may fuse)
    native = True
    if decoded and plan.kernel == "packed":  # bfloat16 weights, float32 sums, bfloat16 out
        y = int4_native.packed_decoded_mm(
            xk.contiguous(), plan.packed, plan.scales_and_zeros, layout.group
        )
    elif decoded:  # the kernel's values: its activations, float32 sums, bfloat16 out
        # float32_values: traced, `x2.bfloat16().float()` would keep x2 unrounded
        xf = epilogues.round_activation_blocks(xk) if q8 else float32_values(xk)
        y = int4_native.decoded_mm(
            xf, plan.packed, plan.scales_and_zeros, layout.group, q8=q8
        ).bfloat16()
        native = False  # rounded to bfloat16 by the graph
    elif q8:
        y = int4_native.int4_mm_q8(xk, plan.packed, plan.scales_and_zeros, layout.group, n)
    elif plan.kernel == "native":
        y = int4_native.int4_mm(xk, plan.packed, plan.scales_and_zeros, layout.group, n)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _row_major(xk), plan.packed, layout.group, plan.scales_and_zeros
        )
        native = False
    if y.shape[1] != n:
        y = y[:, :n]
    materialized = native and y.dtype == out_dtype
    y = y if y.dtype == out_dtype else y.to(out_dtype)
    return plus_bias(y, bias, materialized=materialized)
