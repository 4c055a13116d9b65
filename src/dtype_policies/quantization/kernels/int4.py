"""int4 (weight-only) products.

`_weight_int4pack_mm_for_cpu` for bfloat16 activations on CPU (group size
32/64/128/256 dividing K, N a multiple of 16; per-channel weights use the
largest such group with a repeated scale); elsewhere, dequantize and multiply
in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtype_policies.quantization.kernels import tensor_key
from dtype_policies.quantizers.math import dequantize_grouped

KERNEL_GROUPS = (256, 128, 64, 32)


def dequantize_int4(
    q_nk: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """The float32 (N, K) weight of int4 values `q_nk` with Keras's scales:
    grouped `scale`/`zero` of shape (G, N), or per-channel `scale` (N,)."""
    if block_size > 0:
        return dequantize_grouped(q_nk.t(), scale, zero, block_size).t()
    return q_nk.float() / scale.float()[:, None]


class Int4Runtime:
    """The CPU int4 kernel's packed weight and scale/zero tensor, rebuilt when
    the stored tensors change; `packed` is `None` when the kernel does not apply."""

    __slots__ = ("_key", "group_size", "packed", "scales_and_zeros")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None
        self.group_size = 0

    def needs_refresh(self, stored: tuple[torch.Tensor, ...]) -> bool:
        return tensor_key(*stored) != self._key

    def refresh(
        self,
        q_nk: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        block_size: int,
        stored: tuple[torch.Tensor, ...],
    ) -> None:
        """Rebuilds the packed data from the (N, K) int values `q_nk` of the
        `stored` tensors."""
        self._key = tensor_key(*stored)
        self.packed = None
        n, k = q_nk.shape
        if scale.device.type != "cpu" or n % 16:
            return
        with torch.inference_mode(False), torch.no_grad():
            if block_size > 0:
                if block_size not in KERNEL_GROUPS or k % block_size:
                    return
                group = block_size
                scale_bf16 = scale.to(torch.bfloat16)  # (G, N)
                # The offset comes from the rounded scale, so that (u - 8) * s + z is
                # exactly (q - zero) * s for the s the kernel uses.
                kernel_zero = (-zero.float() * scale_bf16.float()).to(torch.bfloat16)
            else:
                group = next((g for g in KERNEL_GROUPS if k % g == 0), 0)
                if not group:
                    return
                scale_bf16 = (1.0 / scale.float())[None, :].expand(k // group, n)
                scale_bf16 = scale_bf16.to(torch.bfloat16)
                kernel_zero = torch.zeros_like(scale_bf16)
            unsigned = (q_nk.to(torch.int32) + 8).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
            self.scales_and_zeros = torch.stack([scale_bf16, kernel_zero], dim=-1).contiguous()
            self.group_size = group


def int4_linear(
    x2: torch.Tensor,
    q_nk: torch.Tensor | None,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    block_size: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    runtime: Int4Runtime,
) -> torch.Tensor:
    """`x2 @ W.T + bias` for int4 weights `W` (grouped: `(q - zero) * scale`
    along the input axis; per channel: `q / scale`) on a 2-D `x2` (M, K).
    `q_nk` (the int values, (N, K)) is needed when the packed kernel is not used."""
    n = scale.shape[-1]
    if x2.shape[0] == 0:
        return x2.new_zeros((0, n), dtype=out_dtype)
    if runtime.packed is not None and x2.dtype == torch.bfloat16:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.contiguous(), runtime.packed, runtime.group_size, runtime.scales_and_zeros
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)
    weight = dequantize_int4(q_nk, scale, zero, block_size).to(x2.dtype)
    out = F.linear(x2, weight, None if bias is None else bias.to(x2.dtype))
    return out.to(out_dtype)
