"""gptq (weight-only, calibrated): GPTQ's error-compensating rounding
(`quantizers.gptq`) from the Hessian of each weight's inputs on the
calibration data, stored as grouped int4 (2, 3, 4 bits) or int8 (8 bits)
with Keras's `g_idx` (`calibrated_int`), computed on int4's / int8's kernels.

The library's results use the reference GPTQ (the upper Cholesky factor of
the damped inverse Hessian) on grids fixed from the float weights and
re-fitted to the levels (`GPTQConfig(grid="refined")`);
`quantizers.gptq.gptq_quantize(..., inverse="keras", grid="keras")` gives
Keras 3.15's integers exactly."""

from __future__ import annotations

import torch

from dtype_policies._modes import QuantizationMode, register_mode
from dtype_policies.policies.calibrated import GPTQDTypePolicy, bits_not_given
from dtype_policies.quantization.schemes.base import ActivationStatistics, WeightSpec
from dtype_policies.quantization.schemes.calibrated_int import (
    CalibratedIntScheme,
    input_statistics,
)
from dtype_policies.quantizers.gptq import gptq_quantize
from dtype_policies.quantizers.gptq_config import GPTQConfig


class GPTQScheme(CalibratedIntScheme[GPTQConfig]):
    mode = "gptq"
    calibrated_on_quantized_outputs = True

    def quantize_calibrated(
        self,
        weight: torch.Tensor,
        spec: WeightSpec,
        config: GPTQConfig,
        statistics: ActivationStatistics,
    ) -> dict[str, torch.Tensor]:
        statistics = input_statistics(statistics)
        w_nk = spec.nk(spec.matrix(weight.detach())).float()
        levels, scale, zero, g_idx = gptq_quantize(
            w_nk,
            statistics.hessian,
            bits=config.weight_bits,
            group_size=config.block_size(spec.in_features),
            symmetric=config.symmetric,
            per_channel=config.per_channel,
            damping=config.hessian_damping,
            activation_order=config.activation_order,
            grid=config.grid,
            samples=statistics.rows,
        )
        return self.stored_tensors(spec, config, levels, scale, zero, g_idx)


register_mode(
    QuantizationMode(
        name="gptq",
        config_class=GPTQConfig,
        policy_class=GPTQDTypePolicy,
        scheme=GPTQScheme(),
        stored_suffixes=("_int4", "_int8", "_scale", "_zero", "_g_idx"),
        data_suffix="_int4",
        calibrated=True,
        config_for_policy=bits_not_given,
        policy_for_config=lambda config, source: GPTQDTypePolicy(
            config.dtype_policy_string(), source
        ),
        label=lambda config: config.dtype_policy_string(),
    )
)
