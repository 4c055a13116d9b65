"""int8: symmetric weights (`W ~= q / scale`) per output channel or per block
of `block_size` inputs of each (the default: 32), with activations quantized at
run time per block of 32 inputs (the default) or per row (Keras's W8A8
dynamic), or left in the compute dtype (weight-only). Stored: `<w>_int8`
(int8, the weight's own orientation) and `<w>_scale` (float32, (N,) per
channel; per block laid out like the weight, the blocks in place of the input
axis: (N, blocks) for torch's (N, K), (blocks, N) for Keras's (K, N)).
Embedding tables are quantized per row the same way, so a table tied to an
LM head stores the same tensors."""

from __future__ import annotations

import torch

from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.quantized import QuantizedDTypePolicy
from dtype_policies.quantization.kernels import int8 as kernels
from dtype_policies.quantization.schemes.base import (
    QuantizedWeight,
    Scheme,
    WeightSpec,
    quantizer_rounded_product,
)
from dtype_policies.quantizers.config import (
    AbsMaxQuantizer,
    Int8QuantizationConfig,
    default_int8_config,
)
from dtype_policies.quantizers.math import (
    abs_max_quantize,
    abs_max_quantize_blocks,
    expand_blocks,
)


class Int8Scheme(Scheme[Int8QuantizationConfig]):
    mode = "int8"
    roles = ("linear", "embedding")

    def buffer_names(self, spec: WeightSpec, config: Int8QuantizationConfig) -> tuple[str, ...]:
        return (f"{spec.weight}_int8", f"{spec.weight}_scale")

    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: Int8QuantizationConfig
    ) -> dict[str, torch.Tensor]:
        quantizer = config.weight_quantizer or AbsMaxQuantizer()
        w_nk = spec.nk(spec.matrix(weight.detach())).float()
        if config.block_size is None:
            q, scale = abs_max_quantize(w_nk, 1, quantizer.value_range, epsilon=quantizer.epsilon)
            scale = scale.reshape(-1)
        else:
            q, scale = abs_max_quantize_blocks(
                w_nk, config.block_size, quantizer.value_range, quantizer.epsilon
            )
            scale = spec.nk(scale)  # (N, blocks) back in the weight's layout
        data = q.t() if spec.layout == "in_out" else q
        names = self.buffer_names(spec, config)
        return {names[0]: data.contiguous(), names[1]: scale.contiguous()}

    def output_chunk(self, spec: WeightSpec, config: Int8QuantizationConfig) -> int:
        return 1  # steps per output, or per block of an output's inputs

    def stored_shapes(self, spec: WeightSpec, config: Int8QuantizationConfig) -> dict:
        rows, columns = (
            (spec.in_features, spec.out_features)
            if spec.layout == "in_out"
            else (spec.out_features, spec.in_features)
        )
        data, scale = self.buffer_names(spec, config)
        block = config.block_size
        steps: tuple[int, ...] = (spec.out_features,)
        if block is not None:
            blocks = -(-spec.in_features // block)
            in_out = spec.layout == "in_out"
            steps = (blocks, spec.out_features) if in_out else (spec.out_features, blocks)
        return {data: ((rows, columns), torch.int8), scale: (steps, torch.float32)}

    def new_runtime(self) -> kernels.Int8Runtime:
        return kernels.Int8Runtime()

    def _stored(self, module: torch.nn.Module, qw: QuantizedWeight[Int8QuantizationConfig]):
        """`(data, scale)`: the data in its stored layout, the scale (N,) or
        (N, blocks)."""
        name = qw.spec.weight
        data, scale = module._buffers[f"{name}_int8"], module._buffers[f"{name}_scale"]
        assert data is not None and scale is not None  # registered by `quantize`
        if _block_size(qw) is not None:
            scale = qw.spec.nk(scale)
        return data, scale

    def integer_values(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int8QuantizationConfig]
    ) -> torch.Tensor:
        data, _ = self._stored(module, qw)
        return qw.spec.nk(data)

    def dequantize(
        self, module: torch.nn.Module, qw: QuantizedWeight[Int8QuantizationConfig]
    ) -> torch.Tensor:
        data, scale = self._stored(module, qw)
        q_nk = qw.spec.nk(data)
        return q_nk.float() / _per_input(scale.float(), _block_size(qw), q_nk.shape[1])

    def _runtime(
        self,
        module: torch.nn.Module,
        qw: QuantizedWeight[Int8QuantizationConfig],
        prepack: bool,
        blocked: bool = False,
    ):
        data, scale = self._stored(module, qw)
        runtime = qw.runtime  # once: `clear_cast_caches` may replace it meanwhile
        if runtime is None:
            runtime = qw.runtime = self.new_runtime()
        runtime.refresh(data, scale, qw.spec.nk, prepack, blocked, _block_size(qw))
        return runtime

    def linear(self, module, qw, x2, bias, compute):
        if qw.config.own_input_rounding:
            return self._own_rounding_linear(module, qw, x2, bias, compute)
        if bias is not None and bias.dtype != compute:
            bias = bias.to(compute)
        if qw.config.activation_block_size is not None:
            runtime = self._runtime(module, qw, prepack=False, blocked=True)
            return kernels.int8_blocked_linear(x2, runtime, bias, compute)
        if qw.config.weight_only:
            return kernels.int8_weight_only_linear(
                x2, self._runtime(module, qw, prepack=False), bias, compute
            )
        return kernels.int8_linear(x2, self._runtime(module, qw, prepack=True), bias, compute)

    def traced_linear(self, module, qw, x2, bias, compute, needs_grad):
        if qw.config.own_input_rounding:
            return self._own_rounding_linear(module, qw, x2, bias, compute)
        if bias is not None and bias.dtype != compute:
            bias = bias.to(compute)
        data, scale = self._stored(module, qw)
        return kernels.int8_linear_traceable(
            x2,
            qw.spec.nk(data),
            scale,
            bias,
            compute,
            qw.config.weight_only,
            qw.config.activation_block_size,
            _block_size(qw),
            needs_grad,
        )

    def _own_rounding_linear(self, module, qw, x2, bias, compute):
        """W8A8 with the config's own activation quantizer (Keras's rule,
        `s = high / (max|x| + eps)` per row), off the kernels."""
        data, scale = self._stored(module, qw)  # per channel: blocks need the default rule
        quantizer = qw.config.activation_quantizer
        return quantizer_rounded_product(x2, quantizer, qw.spec.nk(data), scale, bias, compute)

    def lookup(self, module, qw, ids, compute):
        data, scale = self._stored(module, qw)
        rows = data[ids].float()
        return (rows / _per_input(scale[ids].float(), _block_size(qw), rows.shape[-1])).to(compute)


def _block_size(qw: QuantizedWeight[Int8QuantizationConfig]) -> int | None:
    """The weight's block of inputs per step, `None` per channel."""
    config = qw.config
    assert isinstance(config, Int8QuantizationConfig)
    return config.block_size


def _per_input(scale: torch.Tensor, block_size: int | None, k: int) -> torch.Tensor:
    """The (..., 1) per-channel or (..., K) per-block scale of (..., K) rows."""
    if block_size is None:
        return scale.unsqueeze(-1)
    return expand_blocks(scale, block_size, k)


def _label(config: Int8QuantizationConfig) -> str:
    if config.weight_only:
        return "int8 weight-only"
    if config.block_size is not None:
        return f"int8/{config.block_size} W8A8"
    if config.activation_block_size is not None:
        return f"int8 W8A8/{config.activation_block_size}"
    return "int8"


register_mode(
    QuantizationMode(
        name="int8",
        config_class=Int8QuantizationConfig,
        policy_class=QuantizedDTypePolicy,
        scheme=Int8Scheme(),
        stored_suffixes=("_int8", "_scale"),
        data_suffix="_int8",
        refused_compute_dtypes=("float16",),
        label=_label,
        default=default_int8_config,
    )
)
