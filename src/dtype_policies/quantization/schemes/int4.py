"""int4 (weight-only): grouped along the contracting axis in blocks (asymmetric
with a zero point, `W ~= (q - zero) * scale`), or per output channel
(symmetric, `W ~= q / scale`), Keras's conventions.

Stored: `<w>_int4` (int8 holding two values per byte along the last axis of
the weight's own orientation), `<w>_scale` (float32, (N,) per channel) and,
grouped, `<w>_scale` and `<w>_zero` (float32: a real-valued zero point, see
`grouped_quantize_with_zero_point`) laid out like the weight with the groups
in place of the input axis, (G, N) for an (in, out) kernel (Keras's `Dense`,
`EinsumDense`, transformers' `Conv1D`) and (N, G) for an (out, in) weight or a
table (`nn.Linear`, Keras's and torch's `Embedding`), so that a table tied to
a head stores one set of tensors; and `<w>_g_idx` (float32, (K,): the group of
each input feature, Keras's `g_idx`, `arange(K) // block_size` here; GPTQ's
activation order permutes it). Checkpoints of earlier versions (an int8 zero
point, (G, N) grids, no `g_idx`) load unchanged in value.
"""

from __future__ import annotations

from typing import cast

import torch

from dtype_policies._compat import compiling
from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.quantized import Int4DTypePolicy, QuantizedDTypePolicy
from dtype_policies.quantization.kernels import int4 as kernels
from dtype_policies.quantization.schemes.base import (
    QuantizedWeight,
    Scheme,
    WeightSpec,
    quantizer_rounded_product,
)
from dtype_policies.quantizers.config import AbsMaxQuantizer, Int4QuantizationConfig
from dtype_policies.quantizers.math import (
    INT4_RANGE,
    abs_max_quantize,
    codes_within_float32,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    packed_int4,
    unpack_int4,
    unpack_int4_rows,
)
from dtype_policies.quantizers.scale_search import search_grouped_int4, search_per_channel_int4
from dtype_policies.quantizers.zero_points import columns_per_chunk, refine_zero_points


class Int4Scheme(Scheme[Int4QuantizationConfig]):
    mode = "int4"
    roles = ("linear", "embedding")

    def buffer_names(self, spec: WeightSpec, config: Int4QuantizationConfig) -> tuple[str, ...]:
        w = spec.weight
        if config.group_size > 0:
            return (f"{w}_int4", f"{w}_scale", f"{w}_zero", f"{w}_g_idx")
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
            if config.refine_zero_points:
                q_kn, zero = refine_zero_points(w_nk.t(), q_kn, scale, zero, config.group_size)
            q_nk = codes_within_float32(q_kn, scale, zero, config.group_size).t()
            extra = {names[1]: _laid_out(spec, scale), names[2]: _laid_out(spec, zero)}
            extra[names[3]] = default_g_idx(spec.in_features, config.group_size, w_nk.device)
        elif config.scale_search:
            q_kn, scale = search_per_channel_int4(w_nk.t(), epsilon=quantizer.epsilon)
            q_nk, extra = q_kn.t(), {names[1]: scale}
        else:
            q_nk, scale = abs_max_quantize(
                w_nk, 1, quantizer.value_range, epsilon=quantizer.epsilon
            )
            extra = {names[1]: scale.reshape(-1)}
        data = q_nk.t() if spec.layout == "in_out" else q_nk
        stored = {names[0]: packed_int4(data.contiguous(), axis=-1)}
        stored.update({name: tensor.contiguous() for name, tensor in extra.items()})
        return stored

    def output_chunk(self, spec: WeightSpec, config: Int4QuantizationConfig) -> int:
        if config.group_size > 0 and config.refine_zero_points:
            # the zero points' solver stops by the error of its chunks of outputs
            return columns_per_chunk(spec.in_features, config.group_size)
        return 1  # grids per output, or per group of an output's inputs

    def stored_shapes(
        self, spec: WeightSpec, config: Int4QuantizationConfig
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        k, n = spec.in_features, spec.out_features
        rows, columns = (k, n) if spec.layout == "in_out" else (n, k)
        names = self.buffer_names(spec, config)
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            names[0]: ((rows, (columns + 1) // 2), torch.int8)
        }
        if config.group_size > 0:
            groups = -(-k // config.group_size)
            grid = (n, groups) if spec.layout == "out_in" else (groups, n)
            shapes[names[1]] = (grid, torch.float32)
            shapes[names[2]] = (grid, torch.float32)
            shapes[names[3]] = ((k,), torch.float32)
        else:
            shapes[names[1]] = ((n,), torch.float32)
        return shapes

    def upgrade_checkpoint(
        self, spec: WeightSpec, config: Int4QuantizationConfig, state_dict: dict, prefix: str
    ) -> None:
        if config.group_size <= 0 or prefix + f"{spec.weight}_int4" not in state_dict:
            return
        scale_key = prefix + f"{spec.weight}_scale"
        zero_key, g_idx_key = prefix + f"{spec.weight}_zero", prefix + f"{spec.weight}_g_idx"
        zero = state_dict.get(zero_key)
        if isinstance(zero, torch.Tensor) and zero.dtype == torch.int8:  # before 0.3
            state_dict[zero_key] = _laid_out(spec, zero.float())  # grids were (G, N)
            state_dict[scale_key] = _laid_out(spec, state_dict[scale_key])
        if g_idx_key not in state_dict:
            state_dict[g_idx_key] = default_g_idx(spec.in_features, config.group_size)

    def new_runtime(self) -> kernels.Int4Runtime:
        return kernels.Int4Runtime()

    def _stored(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int4QuantizationConfig]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(packed, scale, zero)`, grouped scale and zero as (G, N) views
        (`zero` None per channel)."""
        buffers = module._buffers
        w = qw.spec.weight
        # `attach` registers the packed values and the scale as tensors (torch
        # types a module's buffers as optional); only a grouped weight has a zero
        packed, scale = (
            cast(torch.Tensor, buffers[f"{w}_int4"]),
            cast(torch.Tensor, buffers[f"{w}_scale"]),
        )
        zero = buffers.get(f"{w}_zero")
        if zero is not None and qw.spec.layout == "out_in":
            scale, zero = scale.t(), zero.t()
        return packed, scale, zero

    def integer_values(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int4QuantizationConfig]
    ) -> torch.Tensor:
        packed, _, _ = self._stored(module, qw)
        spec = qw.spec
        length = spec.out_features if spec.layout == "in_out" else spec.in_features
        return spec.nk(unpack_int4(packed, length, axis=-1))

    def dequantize(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int4QuantizationConfig]
    ) -> torch.Tensor:
        _, scale, zero = self._stored(module, qw)
        q_nk = self.integer_values(module, qw)
        if zero is None:
            return q_nk.float() / scale.float()[:, None]
        g_idx = module._buffers[f"{qw.spec.weight}_g_idx"]
        return dequantize_grouped(q_nk.t(), scale, zero, qw.config.group_size, g_idx).t()

    def _key_tensors(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int4QuantizationConfig]
    ) -> tuple:
        """The module's own stored buffers (never per-call views: a view is a
        new object on every call)."""
        buffers = module._buffers
        return tuple(buffers[name] for name in qw.buffer_names if buffers.get(name) is not None)

    def _g_idx(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int4QuantizationConfig]
    ) -> torch.Tensor | None:
        """The stored `g_idx` of a grouped weight (the kernel's plan tells a
        natural order from a permuted one), None per channel."""
        if qw.config.group_size <= 0:
            return None
        return module._buffers.get(f"{qw.spec.weight}_g_idx")

    def _current_runtime(self, module, qw) -> tuple[kernels.Int4Runtime, torch.Tensor | None]:
        """The weight's runtime with a plan of its stored tensors, and their
        integer values when this call read them."""
        runtime = qw.runtime  # once: `clear_cast_caches` may replace it meanwhile
        if runtime is None:
            runtime = qw.runtime = self.new_runtime()

        def read() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            _, scale, zero = self._stored(module, qw)
            return self.integer_values(module, qw), scale, zero, self._g_idx(module, qw)

        q_nk = runtime.current(
            self._key_tensors(module, qw),
            read,
            qw.config.group_size,
            activation_block_size=qw.config.activation_block_size,
        )
        return runtime, q_nk

    def refresh_kept(self, module, qw):
        # A frozen graph packs the weight itself but takes the plan's choices
        # (W4A8's float16 pairs, a permuting g_idx): they must be of these values.
        if (
            qw.spec.role == "linear"  # a lookup reads no plan
            and qw.config.activation_quantizer is None
            and self._stored(module, qw)[1].device.type == "cpu"
        ):
            with torch.no_grad():
                self._current_runtime(module, qw)

    def linear(self, module, qw, x2, bias, compute):
        if qw.config.activation_quantizer is not None:
            return self._per_row_quantized_linear(module, qw, x2, bias, compute)
        _, scale, zero = self._stored(module, qw)
        runtime, q_nk = self._current_runtime(module, qw)
        g_idx = None
        path = kernels.int4_path(runtime, x2.shape[0], qw.config.group_size)
        if path not in kernels.KERNELS:
            q_nk = self.integer_values(module, qw) if q_nk is None else q_nk
            g_idx = self._g_idx(module, qw)
        return kernels.int4_linear(
            x2,
            q_nk,
            scale,
            zero,
            qw.config.group_size,
            bias,
            compute,
            runtime,
            path,
            g_idx,
            qw.config.activation_block_size,
        )

    def traced_linear(self, module, qw, x2, bias, compute, needs_grad):
        if qw.config.activation_quantizer is not None:
            return self._per_row_quantized_linear(module, qw, x2, bias, compute)
        _, scale, zero = self._stored(module, qw)
        if scale.device.type != "cpu":
            return super().traced_linear(module, qw, x2, bias, compute, needs_grad)
        return kernels.int4_linear_traced(
            x2,
            self.integer_values(module, qw),
            scale,
            zero,
            qw.config.group_size,
            bias,
            compute,
            None if needs_grad else qw.runtime,
            self._g_idx(module, qw),
            qw.config.activation_block_size,
        )

    def _per_row_quantized_linear(self, module, qw, x2, bias, compute):
        """Per-channel W4A8 (Keras's int4 with an activation quantizer): inputs
        quantized per row by the config's quantizer (`quantizer_rounded_product`)."""
        _, scale, _ = self._stored(module, qw)
        quantizer = qw.config.activation_quantizer
        q_nk = self.integer_values(module, qw)
        return quantizer_rounded_product(x2, quantizer, q_nk, scale, bias, compute)

    def lookup(self, module, qw, ids, compute):
        packed, scale, zero = self._stored(module, qw)
        features = qw.spec.in_features
        # traced: bit operations Inductor fuses and no branch on values (a
        # graph break); eager: one table lookup per byte, steps per block
        eager = not compiling()
        rows = packed[ids]
        q = unpack_int4_rows(rows, features) if eager else unpack_int4(rows, features, -1).float()
        if zero is None:
            return (q / scale[ids].float().unsqueeze(-1)).to(compute)
        rows_scale = scale.t()[ids].float()
        rows_zero = zero.t()[ids].float()
        block = qw.config.group_size
        g_idx = module._buffers[f"{qw.spec.weight}_g_idx"]
        blocks_fit = eager and block > 0 and features % block == 0
        if blocks_fit and kernels.natural_groups(g_idx, features, block):
            # each group's step and offset broadcast over its block
            grouped = q.unflatten(-1, (features // block, block))
            values = (grouped - rows_zero.unsqueeze(-1)) * rows_scale.unsqueeze(-1)
            return values.flatten(-2).to(compute)
        group = g_idx.long()
        return ((q - rows_zero[..., group]) * rows_scale[..., group]).to(compute)


def _laid_out(spec: WeightSpec, grid_gn: torch.Tensor) -> torch.Tensor:
    """A (G, N) grid laid out like the weight: (N, G) for an (out, in) one."""
    return grid_gn.t().contiguous() if spec.layout == "out_in" else grid_gn.contiguous()


def default_g_idx(features: int, block_size: int, device: torch.device | None = None):
    """Keras's `g_idx` of grouped int4: the group of each input feature."""
    return (torch.arange(features, device=device) // block_size).float()


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
        stored_suffixes=("_int4", "_scale", "_zero", "_g_idx"),
        data_suffix="_int4",
        parse_policy=_int4_policy,
        # the legacy `int4_from_X` builds per-channel layers (Keras's loading path)
        config_for_policy=lambda policy: Int4QuantizationConfig(block_size=None),
        policy_for_config=lambda config, source: Int4DTypePolicy(
            f"int4/{config.group_size}", source
        ),
        label=lambda config: (
            f"int4/{config.group_size}" + (" W4A8" if config.activation_block_size else "")
        ),
    )
)
