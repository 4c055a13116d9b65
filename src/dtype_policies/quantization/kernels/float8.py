"""float8 products outside training: the weight's quantize-dequantize is kept.

In a call that builds no autograd graph, a float8 layer's kernel is the same
function of its stored tensors every time: the weight cast to the compute
dtype, quantize-dequantized in float8_e4m3fn with the stored `kernel_scale`
(delayed scaling) or with its own scale (dynamic). `float8_kernel` keeps that
kernel, with the product path this processor runs it by (`_core.products`:
e.g. oneDNN's prepacked layout, or float32 products where bfloat16 ones are
emulated), among the module's kept casts (`weight_casts.keep_derived`): it is
a graph-free copy of a trainable weight, so it lives by their rules (keyed by
the weight's and the scale's storage, address and version, the compute dtype
and the processor; dropped by a training call, `train()`, `eval()` and
`clear_cast_caches`). Per call only the inputs are quantize-dequantized, in
one native call on CPU (`rounded_inputs`): float8 is then a storage and
rounding format on CPU that costs about what its compute dtype costs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dtype_policies import _native as native
from dtype_policies._core.casting import cast_tensor, plus_bias
from dtype_policies._core.products import LinearProduct, linear_product
from dtype_policies._core.weight_casts import WeightCasts, keep_derived
from dtype_policies._cpu import processor
from dtype_policies.quantizers.math import (
    FLOAT8_E4M3_MAX,
    compute_float8_dynamic_scale,
    quantize_and_dequantize,
)

KERNEL = "avx2"  # the native library holding `float8_e4m3_qdq`

# Below this many elements torch's own conversion (fewer ops) is faster.
_ARITHMETIC_MIN_ELEMENTS = 4096


def quantize_dequantize_e4m3(
    x: torch.Tensor, scale: torch.Tensor, compute: torch.dtype
) -> torch.Tensor:
    """`quantizers.math.quantize_and_dequantize(x, scale, float8_e4m3fn,
    compute)`, bit for bit, in vectorized float32 arithmetic: torch's
    float8 -> float32 conversion is scalar code on CPU (about 3 ns per element,
    measured), this is 4-5x faster beyond a few thousand elements.

    `x / scale`, clamped to +-448, is rounded to the e4m3 grid (3 mantissa
    bits; below 2**-6 a fixed step of 2**-9) to nearest even by adding and
    subtracting `1.5 * 2**(e + 20)`, `e` its exponent (at least -6): the sum
    lands in a binade whose last bit is the grid step.

    >>> import torch
    >>> x = torch.randn(8192) * 100
    >>> scale = torch.tensor(0.5)
    >>> mine = quantize_dequantize_e4m3(x, scale, torch.float32)
    >>> torch.equal(mine, quantize_and_dequantize(x, scale, torch.float8_e4m3fn, torch.float32))
    True
    """
    if x.numel() < _ARITHMETIC_MIN_ELEMENTS:
        return quantize_and_dequantize(x, scale, torch.float8_e4m3fn, compute)
    v = x.float() if x.dtype is not torch.float32 else x.clone()
    v.div_(scale).clamp_(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
    exponent = v.view(torch.int32).bitwise_and(0x7F800000).clamp_min_(121 << 23)
    magic = exponent.add_((20 << 23) | 0x400000).view(torch.float32)
    return v.add_(magic).sub_(magic).mul_(scale).to(compute)


def float8_kernel(
    store: WeightCasts | None,
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    compute: torch.dtype,
    to_nk,
    quantize=None,
) -> tuple[torch.Tensor, LinearProduct | None]:
    """`(kernel, product)`: the kernel quantize-dequantized in `compute`, in
    the weight's own shape, and the product path of its (N, K) view
    `to_nk(kernel)` (`None`, or `to_nk` itself `None` for a contraction with
    no (N, K) view: `F.linear` or the layer's contraction), kept in
    `store` under `name` (see the module docstring). `scale` is the stored
    kernel scale, `None` for scales of the weight's own: per tensor, or by
    `quantize` (the weight in `compute` to its quantize-dequantized kernel)
    when given."""

    def make() -> tuple[torch.Tensor, LinearProduct | None]:
        with torch.inference_mode(False), torch.no_grad():
            cast = cast_tensor(weight.detach(), compute)
            if quantize is not None:
                kernel = quantize(cast)
            else:
                kernel_scale = scale
                if kernel_scale is None:
                    kernel_scale = compute_float8_dynamic_scale(cast, FLOAT8_E4M3_MAX)
                kernel = quantize_dequantize_e4m3(cast, kernel_scale, compute)
            nk = None if to_nk is None else to_nk(kernel)
            product = None
            if nk is not None:
                product = linear_product(nk.contiguous(), kept=True)
        return kernel, product

    stored = (weight,) if scale is None else (weight, scale)
    return keep_derived(store, name, stored, (compute, processor()), make)


def float8_linear(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    kernel: torch.Tensor,
    product: LinearProduct | None,
    contract,
    bias: torch.Tensor | None,
    quantize_inputs: bool = True,
) -> torch.Tensor:
    """`contract(qdq(x), kernel) + bias` without autograd; `input_scale` is
    the stored inputs scale, `None` for dynamic scaling; with
    `quantize_inputs=False` (weight-only) `x` is used as it is."""
    xq = rounded_inputs(x, input_scale) if quantize_inputs else x
    y = product(xq, None) if product is not None else contract(xq, kernel)
    return plus_bias(y, bias)


def rounded_inputs(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """`x` quantize-dequantized in e4m3fn with `scale`, or (`None`) its own
    dynamic per-tensor scale, in its dtype, outside autograd: in one call of
    the native `float8_e4m3_qdq` where it runs (a CPU tensor of a float dtype
    and at most `_NATIVE_ROUNDING_MAX_ELEMENTS` elements, no dispatch mode: the
    same values, about 7 us at one row of 576 against 40-70 us in torch's
    ops), else in torch's ops.

    >>> import torch
    >>> x = torch.tensor([[0.3, -1000.0, float("nan")]])
    >>> rounded_inputs(x, torch.tensor(1.0)).tolist()  # clipped at 448; NaN stays
    [[0.3125, -448.0, nan]]
    """
    if _native_rounding(x, scale):
        return torch.ops.dtype_policies.float8_e4m3_qdq(x, scale)
    if scale is None:
        scale = compute_float8_dynamic_scale(x, FLOAT8_E4M3_MAX)
    return quantize_dequantize_e4m3(x, scale, x.dtype)


def _native_rounding(x: torch.Tensor, scale: torch.Tensor | None) -> bool:
    return (
        x.numel() <= _NATIVE_ROUNDING_MAX_ELEMENTS
        and x.device.type == "cpu"
        and type(x) is torch.Tensor
        and x.dtype in _NATIVE_ROUNDING_DTYPES
        and (scale is None or _native_scale(scale))
        and _get_current_dispatch_mode() is None
        and native.available(KERNEL)
    )


def _native_scale(scale: torch.Tensor) -> bool:
    # a float32 scale, as the layers store: torch's ops promote to another
    return (
        type(scale) is torch.Tensor and scale.device.type == "cpu" and scale.dtype is torch.float32
    )


_NATIVE_ROUNDING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Beyond this torch's vectorized ops are faster (2 threads, Zen 4, bfloat16
# inputs: 64 x 576 native 81 us, torch 160; 512 x 576 native 540, torch 391).
_NATIVE_ROUNDING_MAX_ELEMENTS = 65536


def _rounded_inputs_fake(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


native.register_fakes(KERNEL, {"dtype_policies::float8_e4m3_qdq": _rounded_inputs_fake})
