"""How a linear leaf multiplies by its compute-dtype weight, chosen once per
kept weight from what the processor can do (`dtype_policies._cpu`), never by
trying a kernel and catching its error.

* `"onednn_prepacked"`: bfloat16 on a CPU with native bfloat16 products:
  the weight is kept in oneDNN's prepacked layout (the same values; oneDNN
  skips reordering the weight on every call).
* `"float32_products"`: bfloat16 or float16 on a CPU without native products
  of that dtype, where torch's half-precision products are emulated (0.2-0.3x
  float32 at many rows, 0.5-0.9x already at 2-4). Beyond `FEW_ROWS` rows the
  product runs in float32 on the half-precision values and rounds once to the
  compute dtype: a product of two bfloat16 (or two float16) numbers is exact in
  float32 and the accumulation is float32 either way, so the values are those
  of a native product. At `FEW_ROWS` rows, where reading the weight
  dominates, the half-precision weight is multiplied directly: by oneDNN where
  its bfloat16 runs (AVX-512 without native bfloat16: 1.5-1.9x float32 at one
  row, against 1.3x for torch's own product) on a kept weight, else by torch.
  The float32 copy of the rounded weight is made on the first call that needs
  it. On x86 CPUs with AVX2 whose bfloat16 is emulated by torch alone (the
  `avx2` classes), bfloat16 weights multiply up to `KERNEL_ROWS` rows on this
  library's AVX2 kernel instead (`_csrc/bf16_avx2.cpp`: the weight read once
  as it is stored, float32 sums, one rounding; 1.5-1.8x torch's product at
  one row and 3-6x at 2 to 8, faster than float32 products up to 8 rows).
* Prepacked, small weights at a few rows multiply in float32 (see
  `LinearProduct`).
* `None`: `F.linear` in the compute dtype.

>>> import torch
>>> from dtype_policies._core.products import linear_product
>>> product = linear_product(torch.randn(4, 3).bfloat16(), kept=True)
>>> product is None or product.kind in KINDS
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtype_policies import _native as native
from dtype_policies._core.casting import exporting, float32_values, tracing
from dtype_policies._cpu import Processor, hardware_flags, processor
from dtype_policies._derivatives import derivative_free

KINDS = ("onednn_prepacked", "float32_products")

# Up to this many rows a half-precision product without native instructions
# still beats float32 (half the bytes of weight read); beyond it, float32
# products of the rounded values win. 1 thread, 2026-11-26, on AVX-512 without
# native bfloat16 (Skylake-SP) and under AVX2 caps, torch's bfloat16 product
# of 2048 x 5632, 5632 x 2048, 896 x 4864 and 576 x 1536 weights: 1.3x
# float32 at 1 row, 0.55-0.93x at 2 rows, 0.5-0.98x at 4 (an earlier AVX2
# machine gave 4 rows: the conservative bound keeps "never slower").
FEW_ROWS = 1

# Up to `FEW_ROWS` rows, weights of fewer elements than this multiply faster in
# float32 than by oneDNN's prepacked product (its call's fixed cost dominates;
# 1 thread, AMX class, e.g. 576 x 192: 10-12 us against 15-22 us). Where
# half-precision products are emulated, one row of a small weight is faster
# as torch's half-precision product than with two casts around a float32 one
# (576 x 192 on avx512 and under AVX2 caps: 40 us against 62-68 us).
SMALL_ELEMENTS = 1 << 18

# Below this many elements the prepacked product's fixed cost outweighs the
# saved reorder (measured: a 64x64 layer is slower packed, 1024x1024 faster).
PREPACK_MIN_ELEMENTS = 1 << 16

# From this many elements oneDNN's emulated bfloat16 multiplies one row faster
# than torch's product (`onednn_gemv`); below, its per-call cost eats the gain
# (1 thread, Skylake-SP, weights read from memory: 576 x 576 0.76x torch's,
# 576 x 1536 1.1x, 576 x 49152 1.35x, 2048 x 5632 1.6x; SmolLM2-135M's decode
# step 8% slower with every weight on oneDNN).
ONEDNN_GEMV_MIN_ELEMENTS = 1 << 21

# Up to this many rows the AVX2 bfloat16 kernel beats float32 products of the
# rounded values (AMD Zen 3, 1 thread, 2026-11-29, weights 576 x 192 to
# 2048 x 8192 read from memory: 1.5-3x at 1 row, 1.9-2.6x at 8, about equal at
# 16; in cache 1.0-2.5x at 8).
KERNEL_ROWS = 8
KERNEL = "avx2"  # the native library holding `bf16_mm_avx2`

_PREPACK_OPS = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def native_half_products(dtype: torch.dtype, cpu: Processor) -> bool:
    """Whether products in `dtype` run on native instructions of `cpu` (half
    precision may be emulated, slow beyond a few rows; other dtypes are native)."""
    if dtype is torch.bfloat16:
        return cpu.native_bf16
    if dtype is torch.float16:
        return cpu.native_fp16
    return True


def product_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype in which products of `dtype` values run on `device`: float32
    on a CPU that emulates `dtype`'s products (the same values, at float32
    speed), else `dtype` itself.

    >>> product_dtype(torch.float32, torch.device("cpu"))
    torch.float32
    """
    if device.type == "cpu" and not native_half_products(dtype, processor()):
        return torch.float32
    return dtype


def product_kind(weight: torch.Tensor, kept: bool, cpu: Processor | None = None) -> str | None:
    """The product path for a compute-dtype (N, K) `weight` (`kept`: a
    graph-free weight kept between calls, which may be prepacked)."""
    return kind_for(weight.dtype, weight.device, weight.numel(), weight.dim(), kept, cpu)


def kind_for(
    dtype: torch.dtype,
    device: torch.device,
    numel: int,
    dim: int = 2,
    kept: bool = True,
    cpu: Processor | None = None,
) -> str | None:
    """`product_kind` for a weight of this dtype, device and size."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    cpu = processor() if cpu is None else cpu
    if not native_half_products(dtype, cpu):
        return "float32_products"
    if (
        kept
        and _PREPACK_OPS
        and dtype is torch.bfloat16
        and cpu.onednn_bf16
        and numel >= PREPACK_MIN_ELEMENTS
        and dim == 2
    ):
        return "onednn_prepacked"
    return None


def describe(kind: str | None, dtype: torch.dtype, numel: int | None = None) -> str:
    """A short description of a product path, for reports (`numel`: the
    weight's size, which decides the one-row product; `None`: a small one).

    >>> describe("float32_products", torch.float16)
    'float16 weight at 1 row, float32 products of its values beyond'
    """
    name = str(dtype).removeprefix("torch.")
    if kind == "onednn_prepacked":
        return f"oneDNN {name}, prepacked weight"
    if kind == "float32_products":
        few = f"{FEW_ROWS} row" if FEW_ROWS == 1 else f"up to {FEW_ROWS} rows"
        large = numel is not None and numel >= ONEDNN_GEMV_MIN_ELEMENTS
        cpu = processor()
        if dtype is torch.bfloat16 and bf16_kernel(cpu):
            return (
                f"{name} weight up to {KERNEL_ROWS} rows (this library's AVX2 kernel), "
                "float32 products of its values beyond"
            )
        by = "oneDNN " if large and onednn_gemv(dtype, cpu) else ""
        return f"{by}{name} weight at {few}, float32 products of its values beyond"
    return f"F.linear {name}"


_kernel_built: list[bool] = []  # read once; a plain global, traced through by compilers


def bf16_kernel(cpu: Processor) -> bool:
    """Whether a bfloat16 weight without native products multiplies a few
    rows on this library's AVX2 kernel: x86 with AVX2 and FMA, bfloat16
    emulated by torch alone (where oneDNN emulates it, `onednn_gemv` decides:
    the kernel is not measured there), the kernel built. The first call
    outside a trace builds it (cached on disk); a trace never builds one."""
    if cpu.native_bf16 or cpu.onednn_bf16 or "avx2" not in cpu.features:
        return False
    if tracing():  # decided as the eager call would be, without building
        if exporting():  # a program that runs without this library
            return False
        return _kernel_built[0] if _kernel_built else native.loaded(KERNEL)
    if not native.enabled():  # `DTYPE_POLICIES_NATIVE_KERNELS=0`, read when asked
        return False
    if not _kernel_built:
        hardware = hardware_flags()
        _kernel_built.append("avx2" in hardware and "fma" in hardware and native.available(KERNEL))
    return _kernel_built[0]


def _kernel_product_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


native.register_fakes(KERNEL, {"dtype_policies::bf16_mm_avx2": _kernel_product_fake})


def onednn_gemv(dtype: torch.dtype, cpu: Processor) -> bool:
    """Whether a kept half-precision weight without native products is
    multiplied by oneDNN at `FEW_ROWS` rows (its emulated bfloat16 reads the
    plain weight faster than torch's product there)."""
    return dtype is torch.bfloat16 and _PREPACK_OPS and cpu.onednn_bf16 and not cpu.native_bf16


class LinearProduct:
    """`F.linear(x, weight, bias)` by one of the `KINDS`, for one weight.

    Built by `linear_product` when the weight is cast; immutable except for
    the float32 copy made on first use (a concurrent first use makes it twice,
    with the same values). Up to `FEW_ROWS` rows a prepacked weight of fewer
    than `SMALL_ELEMENTS` elements is multiplied in float32: the fixed cost
    of a oneDNN call dominates there. `onednn`:
    a graph-free `float32_products` weight multiplied by oneDNN at `FEW_ROWS`
    rows (`onednn_gemv`; oneDNN's product has no autograd). `kernel`: a
    `float32_products` bfloat16 weight multiplied up to `KERNEL_ROWS` rows on
    this library's AVX2 kernel (`bf16_kernel`) where no derivative can be
    asked for (`_derivatives.derivative_free`: the kernel has no derivatives
    and no batching rule; elsewhere, the rule above).
    """

    __slots__ = (
        "_float32",
        "dtype",
        "kernel",
        "kind",
        "onednn",
        "portable",
        "small",
        "traced",
        "weight",
    )

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor,
        dtype: torch.dtype,
        float32: torch.Tensor | None = None,
        onednn: bool = False,
        traced: bool = False,
        kernel: bool = False,
        portable: bool = False,
    ) -> None:
        self.kind = kind
        self.portable = portable
        self.kernel = kernel
        self.weight = weight
        self.dtype = dtype
        self._float32 = float32
        self.small = float32 is not None
        self.onednn = onednn
        self.traced = traced

    def float32_weight(self) -> torch.Tensor:
        """The weight's values in float32 (kept when the weight carries no
        graph; computed in the graph when traced, where freezing folds it)."""
        weight32 = self._float32
        if weight32 is None:
            if self.traced or self.weight.requires_grad:
                return float32_values(self.weight)
            with torch.inference_mode(False), torch.no_grad():
                weight32 = self.weight.float()
            self._float32 = weight32
        return weight32

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.portable:  # the values of every path below, whatever the rows
            out = F.linear(
                float32_values(x2),
                float32_values(self.weight),
                None if bias is None else float32_values(bias),
            )
            out = out.to(self.dtype)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        rows = x2.shape[0]
        if self.kernel and rows <= KERNEL_ROWS and self._kernel_applies(x2, bias):
            out = torch.ops.dtype_policies.bf16_mm_avx2(x2, self.weight, bias)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        few = rows <= FEW_ROWS
        if self.kind == "onednn_prepacked" and not (few and self.small):
            return torch.ops.mkldnn._linear_pointwise(
                x if x.is_contiguous() else x.contiguous(), self.weight, bias, "none", [], ""
            )
        if few and not self.small:
            if self.onednn:
                return torch.ops.mkldnn._linear_pointwise(
                    x if x.is_contiguous() else x.contiguous(), self.weight, bias, "none", [], ""
                )
            out = F.linear(x2, self.weight, bias)
        else:
            out = F.linear(
                float32_values(x2),
                self.float32_weight(),
                None if bias is None else float32_values(bias),
            ).to(self.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def _kernel_applies(self, x2: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if x2.dtype is not torch.bfloat16:
            return False
        if bias is not None and bias.dtype not in (torch.bfloat16, torch.float32):
            return False
        return derivative_free(x2, self.weight, bias)

    def __repr__(self) -> str:
        return f"LinearProduct({self.kind}, {tuple(self.weight.shape)} {self.dtype})"


def linear_product(weight: torch.Tensor, kept: bool) -> LinearProduct | None:
    """The product of the compute-dtype (N, K) `weight`, or `None` for a
    plain `F.linear`. A prepacked weight is packed here (graph-free only)."""
    graph_free = kept and not weight.requires_grad
    kind = product_kind(weight, graph_free)
    if kind is None:
        return None
    float32 = None
    dtype = weight.dtype
    with torch.inference_mode(False), torch.no_grad():
        if graph_free and kind == "onednn_prepacked" and weight.numel() < SMALL_ELEMENTS:
            float32 = weight.float()
        if kind == "onednn_prepacked":
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    onednn = (
        kind == "float32_products"
        and graph_free
        and weight.dim() == 2
        and weight.numel() >= ONEDNN_GEMV_MIN_ELEMENTS
        and onednn_gemv(dtype, processor())
    )
    if onednn:
        weight = weight.contiguous()
    # The kernel reads rows of the weight as stored: a transposed view (GPT-2's
    # Conv1D) is copied once when kept, else left to the rule above.
    kernel = (
        kind == "float32_products"
        and _kernel_for(weight, dtype)
        and (graph_free or weight.is_contiguous())
    )
    if kernel and not weight.is_contiguous():
        with torch.inference_mode(False), torch.no_grad():
            weight = weight.contiguous()
    return LinearProduct(kind, weight, dtype, float32, onednn, kernel=kernel)


def _kernel_for(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        dtype is torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and bf16_kernel(processor())
    )


def traced_product(weight: torch.Tensor) -> LinearProduct | None:
    """The product of the compute-dtype (N, K) `weight` for compilers and
    tracers, in plain ops, by the same rule as the eager one: on a CPU without
    native products of its dtype, float32 products of its values beyond
    `FEW_ROWS` rows (exporting: at every row count, so that the program
    holds no branch on the rows). `None`: a plain `F.linear` (the compiler
    chooses the product)."""
    kind = kind_for(weight.dtype, weight.device, weight.numel(), weight.dim(), kept=False)
    if kind != "float32_products":
        return None
    if exporting():
        return LinearProduct(kind, weight, weight.dtype, traced=True, portable=True)
    kernel = _kernel_for(weight, weight.dtype)
    if kernel:  # a plain op: freezing folds it into the constant
        weight = weight.contiguous()
    return LinearProduct(kind, weight, weight.dtype, traced=True, kernel=kernel)
