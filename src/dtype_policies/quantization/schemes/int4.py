"""int4 (weight-only): grouped along the contracting axis in blocks (asymmetric
with a zero point, `W ~= (q - zero) * scale`), or per output channel
(symmetric, `W ~= q / scale`), Keras's conventions. Stored: `<w>_int4` (int8
holding two values per byte along the last axis of the weight's own
orientation), `<w>_scale` (float32, (G, N) grouped or (N,) per channel) and,
grouped, `<w>_zero` (int8, (G, N))."""

from __future__ import annotations

import torch

from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.quantized import Int4DTypePolicy, QuantizedDTypePolicy
from dtype_policies.quantization.kernels import int4 as kernels
from dtype_policies.quantization.schemes.base import QuantizedWeight, Scheme, WeightSpec
from dtype_policies.quantizers.config import AbsMaxQuantizer, Int4QuantizationConfig
from dtype_policies.quantizers.math import (
    INT4_RANGE,
    abs_max_quantize,
    grouped_quantize_with_zero_point,
    pack_int4,
    unpack_int4,
)
from dtype_policies.quantizers.scale_search import search_grouped_int4, search_per_channel_int4


class Int4Scheme(Scheme):
    mode = "int4"
    roles = ("linear", "embedding")

    def buffer_names(self, spec: WeightSpec, config: Int4QuantizationConfig) -> tuple[str, ...]:
        w = spec.weight
        if config.group_size > 0:
            return (f"{w}_int4", f"{w}_scale", f"{w}_zero")
        return (f"{w}_int4", f"{w}_scale")

    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: Int4QuantizationConfig
    ) -> dict[str, torch.Tensor]:
        w_nk = spec.nk(spec.matrix(weight.detach())).float()
        names = self.buffer_names(spec, config)
        quantizer = config.weight_quantizer or AbsMaxQuantizer(value_range=INT4_RANGE)
        if config.group_size > 0:
            grouped = (
                search_grouped_int4 if config.scale_search else grouped_quantize_with_zero_point
            )
            q_kn, scale, zero = grouped(w_nk.t(), config.group_size)
            q_nk, extra = q_kn.t(), {names[1]: scale, names[2]: zero}
        elif config.scale_search:
            q_kn, scale = search_per_channel_int4(w_nk.t(), epsilon=quantizer.epsilon)
            q_nk, extra = q_kn.t(), {names[1]: scale}
        else:
            q_nk, scale = abs_max_quantize(w_nk, 1, quantizer.value_range, quantizer.epsilon)
            extra = {names[1]: scale.reshape(-1)}
        data = q_nk.t() if spec.layout == "in_out" else q_nk
        stored = {names[0]: pack_int4(data.contiguous(), axis=-1)}
        stored.update({name: tensor.contiguous() for name, tensor in extra.items()})
        return stored

    def stored_shapes(self, spec: WeightSpec, config: Int4QuantizationConfig) -> dict:
        k, n = spec.in_features, spec.out_features
        rows, columns = (k, n) if spec.layout == "in_out" else (n, k)
        names = self.buffer_names(spec, config)
        shapes = {names[0]: ((rows, (columns + 1) // 2), torch.int8)}
        if config.group_size > 0:
            groups = -(-k // config.group_size)
            shapes[names[1]] = ((groups, n), torch.float32)
            shapes[names[2]] = ((groups, n), torch.int8)
        else:
            shapes[names[1]] = ((n,), torch.float32)
        return shapes

    def new_runtime(self) -> kernels.Int4Runtime:
        return kernels.Int4Runtime()

    def _stored(self, module: torch.nn.Module, qw: QuantizedWeight):
        buffers = module._buffers
        w = qw.spec.weight
        return buffers[f"{w}_int4"], buffers[f"{w}_scale"], buffers.get(f"{w}_zero")

    def integer_values(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        packed, _, _ = self._stored(module, qw)
        spec = qw.spec
        length = spec.out_features if spec.layout == "in_out" else spec.in_features
        return spec.nk(unpack_int4(packed, length, axis=-1))

    def dequantize(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        _, scale, zero = self._stored(module, qw)
        return kernels.dequantize_int4(
            self.integer_values(module, qw), scale, zero, qw.config.group_size
        )

    def linear(self, module, qw, x2, bias, compute):
        packed, scale, zero = self._stored(module, qw)
        if qw.runtime is None:
            qw.runtime = self.new_runtime()
        stored = (packed, scale) if zero is None else (packed, scale, zero)
        q_nk = None
        if qw.runtime.needs_refresh(stored):
            q_nk = self.integer_values(module, qw)
            qw.runtime.refresh(q_nk, scale, zero, qw.config.group_size, stored)
        if kernels.int4_path(qw.runtime, x2.shape[0], qw.config.group_size) != "packed":
            q_nk = self.integer_values(module, qw) if q_nk is None else q_nk
        return kernels.int4_linear(
            x2, q_nk, scale, zero, qw.config.group_size, bias, compute, qw.runtime
        )

    def traced_linear(self, module, qw, x2, bias, compute, needs_grad):
        _, scale, zero = self._stored(module, qw)
        if scale.device.type != "cpu":
            return super().traced_linear(module, qw, x2, bias, compute, needs_grad)
        q_nk = self.integer_values(module, qw)
        weight = kernels.kernel_weight(q_nk, scale, zero, qw.config.group_size)
        return kernels.int4_linear_traceable(x2, weight, bias, compute)

    def lookup(self, module, qw, ids, compute):
        packed, scale, zero = self._stored(module, qw)
        features = qw.spec.in_features
        q = unpack_int4(packed[ids], features, axis=-1).float()
        if zero is None:
            return (q / scale[ids].float().unsqueeze(-1)).to(compute)
        group = torch.arange(features, device=q.device) // qw.config.group_size
        rows_scale = scale.t()[ids].float()[..., group]
        rows_zero = zero.t()[ids].float()[..., group]
        return ((q - rows_zero) * rows_scale).to(compute)


def _int4_policy(mode: str, source_name: str) -> QuantizedDTypePolicy:
    """`"int4/<block>"` names an `Int4DTypePolicy`; the legacy `"int4"` a
    per-channel `QuantizedDTypePolicy` (as in Keras)."""
    if "/" in mode:
        return Int4DTypePolicy(mode, source_name)
    return QuantizedDTypePolicy(mode, source_name)


register_mode(
    QuantizationMode(
        name="int4",
        config_class=Int4QuantizationConfig,
        policy_class=Int4DTypePolicy,
        scheme=Int4Scheme(),
        stored_suffixes=("_int4", "_scale", "_zero"),
        data_suffix="_int4",
        parse_policy=_int4_policy,
        # the legacy `int4_from_X` builds per-channel layers (Keras's loading path)
        config_for_policy=lambda policy: Int4QuantizationConfig(block_size=None),
        policy_for_config=lambda config, source: Int4DTypePolicy(
            f"int4/{config.group_size}", source
        ),
        label=lambda config: f"int4/{config.group_size}",
    )
)
