"""awq (weight-only, calibrated): per-input-feature scales `s` from the
activations (`quantizers.awq`), the weight quantized as `W * s` in grouped
int4 (`calibrated_int`), the input divided by `s` (stored `<w>_awq_scales`,
float32 (K,)) before the int4 kernel."""

from __future__ import annotations

from typing import cast

import torch

from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.calibrated import AWQDTypePolicy, bits_not_given
from dtype_policies.quantization.schemes.base import (
    ActivationStatistics,
    QuantizedWeight,
    WeightSpec,
)
from dtype_policies.quantization.schemes.calibrated_int import (
    CalibratedIntScheme,
    InputStatistics,
    input_statistics,
)
from dtype_policies.quantizers.awq import awq_quantize_matrix, awq_quantize_output
from dtype_policies.quantizers.awq_config import AWQConfig


class AWQScheme(CalibratedIntScheme[AWQConfig]):
    mode = "awq"
    extra_buffers = ("awq_scales",)
    calibrated_on_quantized_outputs = True

    def new_statistics(self, spec: WeightSpec, config: AWQConfig) -> InputStatistics:
        if config.objective == "weight":  # Keras's: the maximum |x| per input feature
            return InputStatistics(spec.in_features, gram=False, max_abs=True)
        return InputStatistics(spec.in_features, mean_abs=True)

    def quantize_calibrated(
        self,
        weight: torch.Tensor,
        spec: WeightSpec,
        config: AWQConfig,
        statistics: ActivationStatistics,
    ) -> dict[str, torch.Tensor]:
        statistics = input_statistics(statistics)
        w_nk = spec.nk(spec.matrix(weight.detach())).float()
        group = config.block_size(spec.in_features)
        if config.objective == "weight":
            if statistics.abs_max is None:  # `new_statistics` gathers it for this objective
                raise RuntimeError("AWQ's weight objective needs the inputs' maximum |x|.")
            levels, scale, zero, scales, g_idx = awq_quantize_matrix(
                w_nk,
                statistics.abs_max,
                num_grid_points=config.num_grid_points,
                group_size=-1 if config.group_size == -1 else group,
            )
        else:
            levels, scale, zero, scales, g_idx = awq_quantize_output(
                w_nk,
                statistics.hessian,
                statistics.mean_abs,
                num_grid_points=config.num_grid_points,
                group_size=group,
                grid=config.grid,
                samples=statistics.rows,
            )
        return self.stored_tensors(spec, config, levels, scale, zero, g_idx, (scales,))

    def input_divisor(
        self, module: torch.nn.Module, qw: QuantizedWeight[AWQConfig]
    ) -> torch.Tensor:
        # `<w>_awq_scales`, after the int4 tensors: `attach` registers it as a
        # tensor (torch types a module's buffers as optional)
        return cast(torch.Tensor, module._buffers[qw.buffer_names[4]])


register_mode(
    QuantizationMode(
        name="awq",
        config_class=AWQConfig,
        policy_class=AWQDTypePolicy,
        scheme=AWQScheme(),
        stored_suffixes=("_int4", "_scale", "_zero", "_g_idx", "_awq_scales"),
        data_suffix="_int4",
        calibrated=True,
        config_for_policy=bits_not_given,
        policy_for_config=lambda config, source: AWQDTypePolicy(
            config.dtype_policy_string(), source
        ),
        label=lambda config: config.dtype_policy_string(),
    )
)
