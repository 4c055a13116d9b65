"""Quantized weights of linear-like modules: what is stored, and the forward.

A linear-like module multiplies its input's last axis (K) by a weight with N
outputs. The stored weight has one of two orientations: `"kn"` (Keras's Dense
kernel, `(K, N)`) or `"nk"` (torch's `nn.Linear.weight`, `(N, K)`). For a
weight registered as `<prefix>` the stored tensors are:

* int8: `<prefix>` int8 (the weight's own shape) and `<prefix>_scale` float32
  `(N,)`, with `W ≈ q / scale`;
* int4 grouped (block B along K): `<prefix>` int8 holding two values per byte
  (packed along N for `"kn"`, along K for `"nk"`), `<prefix>_scale` float32
  and `<prefix>_zero` int8, both `(ceil(K / B), N)`, with
  `W ≈ (q - zero) * scale`;
* int4 per channel: `<prefix>` packed as above and `<prefix>_scale` `(N,)`,
  with `W ≈ q / scale`;
* float8: `<prefix>` stays a float parameter; six float32 delayed-scaling
  buffers are added (see `float8.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtype_policies.quantization import float8, kernels
from dtype_policies.quantization.config import (
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationConfig,
)
from dtype_policies.quantization.quantizers import (
    abs_max_quantize,
    grouped_quantize_with_zero_point,
    pack_int4,
    unpack_int4,
)


class LinearQuantization:
    """The quantization of one linear-like weight: its layout, its stored
    tensors, and the quantized product.

    Attributes:
        mode: `"int8"`, `"int4"` or `"float8"`.
        prefix: The weight's registered name (`"kernel"`, `"weight"`).
        layout: `"kn"` or `"nk"`.
        in_features, out_features: K and N.
        weight_only: int8 without activation quantization.
        block_size: int4 group size along K, `-1` per channel.
        history_length: float8 amax history length.
    """

    def __init__(
        self,
        mode: str,
        prefix: str,
        layout: str,
        in_features: int,
        out_features: int,
        config: QuantizationConfig,
        history_length: int = 1024,
    ) -> None:
        if layout not in ("kn", "nk"):
            raise ValueError(f"layout must be 'kn' or 'nk'. Received: {layout!r}")
        self.mode = mode
        self.prefix = prefix
        self.layout = layout
        self.in_features = in_features
        self.out_features = out_features
        self.config = config
        self.weight_only = isinstance(config, Int8QuantizationConfig) and config.weight_only
        self.block_size = config.block_size if isinstance(config, Int4QuantizationConfig) else -1
        self.history_length = history_length
        self._int8 = kernels.Int8Runtime()
        self._int4 = kernels.Int4Runtime()

    @property
    def names(self) -> tuple[str, ...]:
        """The buffer names this quantization registers."""
        p = self.prefix
        if self.mode == "int8":
            return (p, f"{p}_scale")
        if self.mode == "int4":
            return (p, f"{p}_scale", f"{p}_zero") if self.block_size > 0 else (p, f"{p}_scale")
        return float8.STATE_NAMES

    # ------------------------------------------------------------ quantizing

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors to store for the float `weight` (in this layout)."""
        w_kn = (weight.t() if self.layout == "nk" else weight).detach().float()
        p = self.prefix
        if self.mode == "int8":
            quantizer = self.config.weight_quantizer
            q, scale = abs_max_quantize(w_kn, 0, quantizer.value_range, quantizer.epsilon)
            return {p: self._orient(q), f"{p}_scale": scale.reshape(-1)}
        if self.mode == "int4":
            if self.block_size > 0:
                q, scale, zero = grouped_quantize_with_zero_point(w_kn, self.block_size)
                return {p: self._pack(q), f"{p}_scale": scale, f"{p}_zero": zero}
            quantizer = self.config.weight_quantizer
            q, scale = abs_max_quantize(w_kn, 0, quantizer.value_range, quantizer.epsilon)
            return {p: self._pack(q), f"{p}_scale": scale.reshape(-1)}
        raise AssertionError(f"mode {self.mode} keeps its float weight")

    def _orient(self, q_kn: torch.Tensor) -> torch.Tensor:
        return q_kn.t().contiguous() if self.layout == "nk" else q_kn.contiguous()

    def _pack(self, q_kn: torch.Tensor) -> torch.Tensor:
        return pack_int4(self._orient(q_kn), axis=1)

    def q_nk(self, module: torch.nn.Module) -> torch.Tensor:
        """The stored int8 values as an (N, K) matrix (a view for int8)."""
        stored = module._buffers[self.prefix]
        if self.mode == "int4":
            length = self.out_features if self.layout == "kn" else self.in_features
            stored = unpack_int4(stored, length, axis=1)
        return stored.t() if self.layout == "kn" else stored

    def dequantized_weight(self, module: torch.nn.Module) -> torch.Tensor:
        """The float32 weight the stored tensors represent, in this layout."""
        if self.mode == "float8":
            return module._parameters[self.prefix].detach().float()
        buffers = module._buffers
        scale = buffers[f"{self.prefix}_scale"]
        if self.mode == "int8":
            w_nk = self.q_nk(module).float() / scale.float()[:, None]
        else:
            w_nk = kernels.dequantize_int4(
                self.q_nk(module), scale, buffers.get(f"{self.prefix}_zero"), self.block_size
            )
        return w_nk.t() if self.layout == "kn" else w_nk

    # ------------------------------------------------------------ forward

    def forward(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        training: bool = False,
    ) -> torch.Tensor:
        """`x @ W + bias` (Keras's Dense convention) with the quantized `W`."""
        buffers = module._buffers
        if self.mode == "int8":
            q_nk = self.q_nk(module)
            inverse = self._inverse_scale(buffers[f"{self.prefix}_scale"])
            if self.weight_only:
                return kernels.int8_weight_only_linear(x, q_nk, inverse, bias, out_dtype)
            return kernels.int8_linear(x, q_nk, inverse, bias, out_dtype, self._int8)
        if self.mode == "int4":
            stored = buffers[self.prefix]
            scale = buffers[f"{self.prefix}_scale"]
            zero = buffers.get(f"{self.prefix}_zero")
            tensors = (stored, scale) if zero is None else (stored, scale, zero)
            return kernels.int4_linear(
                x,
                lambda: self.q_nk(module),
                tensors,
                scale,
                zero,
                self.block_size,
                self.out_features,
                bias,
                out_dtype,
                self._int4,
            )
        weight = getattr(module, self.prefix)  # the float kernel, in the compute dtype

        def contract(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.linear(a, w.t() if self.layout == "kn" else w)

        y = float8.float8_contract(module, x, weight, contract, training)
        if bias is not None:
            y = y + bias
        return y.to(out_dtype)

    def _inverse_scale(self, scale: torch.Tensor) -> torch.Tensor:
        cached = getattr(self, "_inverse_cache", None)
        key = (scale._version, scale.data_ptr())
        if cached is None or cached[0] != key:
            cached = (key, 1.0 / scale.float())
            self._inverse_cache = cached
        return cached[1]

    def __getstate__(self) -> dict[str, Any]:  # runtime caches are rebuilt after copying
        state = self.__dict__.copy()
        state["_int8"] = kernels.Int8Runtime()
        state["_int4"] = kernels.Int4Runtime()
        state.pop("_inverse_cache", None)
        return state


def default_config(mode: str, policy: Any = None) -> QuantizationConfig:
    """The config a quantized policy implies (int4 block size, float8 history)."""
    from dtype_policies.policies import int4_block_size

    if mode == "int4":
        return Int4QuantizationConfig(block_size=int4_block_size(policy) if policy else 128)
    if mode == "float8":
        return Float8QuantizationConfig(getattr(policy, "amax_history_length", None))
    return Int8QuantizationConfig()


def quantized_policy_name(mode: str, config: QuantizationConfig, source_name: str) -> Any:
    """The policy a module gets after quantization: `<mode>_from_<source>`."""
    from dtype_policies.policies import (
        Int4DTypePolicy,
        QuantizedDTypePolicy,
        QuantizedFloat8DTypePolicy,
    )

    if mode == "int4":
        return Int4DTypePolicy(f"int4/{config.block_size}", source_name)
    if mode == "float8":
        length = (
            config.amax_history_length or QuantizedFloat8DTypePolicy.default_amax_history_length
        )
        return QuantizedFloat8DTypePolicy("float8", source_name, length)
    return QuantizedDTypePolicy(mode, source_name)
