"""Quantized embedding tables: what is stored, and the lookup.

For a table `(V, D)` registered as `<prefix>`, quantized per vocabulary row:

* int8: `<prefix>` int8 `(V, D)` and `<prefix>_scale` float32 `(V,)`,
  `row ≈ q / scale`;
* int4 grouped (block B along D): `<prefix>` int8 with two values per byte
  along D, `<prefix>_scale` float32 and `<prefix>_zero` int8, both
  `(V, ceil(D / B))`, `row ≈ (q - zero) * scale`;
* int4 per row: `<prefix>` packed as above and `<prefix>_scale` `(V,)`.

Lookups gather the stored rows first and dequantize only those.
"""

from __future__ import annotations

import torch

from dtype_policies.quantization.config import Int4QuantizationConfig, QuantizationConfig
from dtype_policies.quantization.kernels import _run_fused
from dtype_policies.quantization.quantizers import (
    abs_max_quantize,
    grouped_quantize_with_zero_point,
    pack_int4,
    unpack_int4,
)


def _lookup_int8(ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    return (q[ids].float() / scale[ids].unsqueeze(-1)).to(dtype)


class EmbeddingQuantization:
    """The quantization of one embedding table (modes int8 and int4)."""

    def __init__(
        self,
        mode: str,
        prefix: str,
        num_embeddings: int,
        embedding_dim: int,
        config: QuantizationConfig,
    ) -> None:
        self.mode = mode
        self.prefix = prefix
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.config = config
        self.block_size = config.block_size if isinstance(config, Int4QuantizationConfig) else -1

    @property
    def names(self) -> tuple[str, ...]:
        p = self.prefix
        if self.mode == "int4" and self.block_size > 0:
            return (p, f"{p}_scale", f"{p}_zero")
        return (p, f"{p}_scale")

    def quantize(self, table: torch.Tensor) -> dict[str, torch.Tensor]:
        table = table.detach().float()
        p = self.prefix
        if self.mode == "int8":
            q, scale = abs_max_quantize(table, -1)
            return {p: q, f"{p}_scale": scale.reshape(-1)}
        if self.block_size > 0:
            q_t, scale, zero = grouped_quantize_with_zero_point(table.t(), self.block_size)
            return {
                p: pack_int4(q_t.t().contiguous(), axis=1),
                f"{p}_scale": scale.t().contiguous(),
                f"{p}_zero": zero.t().contiguous(),
            }
        q, scale = abs_max_quantize(table, -1, value_range=(-8, 7))
        return {p: pack_int4(q, axis=1), f"{p}_scale": scale.reshape(-1)}

    def _rows(self, module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows for `ids` (int4)."""
        buffers = module._buffers
        q = unpack_int4(buffers[self.prefix][ids], self.embedding_dim, axis=-1).float()
        scale = buffers[f"{self.prefix}_scale"][ids].float()
        if self.block_size <= 0:
            return q / scale.unsqueeze(-1)
        zero = buffers[f"{self.prefix}_zero"][ids].float()
        group = torch.arange(self.embedding_dim, device=q.device) // self.block_size
        return (q - zero[..., group]) * scale[..., group]

    def lookup(
        self, module: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()
        buffers = module._buffers
        if self.mode == "int8":
            return _run_fused(
                _lookup_int8, ids, buffers[self.prefix], buffers[f"{self.prefix}_scale"], dtype
            )
        return self._rows(module, ids).to(dtype)

    def dequantized_weight(self, module: torch.nn.Module) -> torch.Tensor:
        ids = torch.arange(self.num_embeddings, device=module._buffers[self.prefix].device)
        if self.mode == "int8":
            buffers = module._buffers
            return buffers[self.prefix].float() / buffers[f"{self.prefix}_scale"][:, None]
        return self._rows(module, ids)
