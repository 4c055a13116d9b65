"""Quantization: the model-level `quantize`, its report, the registry of
quantizable module kinds, calibration text sampled from the model, and
(re-exported from `dtype_policies.quantizers`) the configs.

>>> from dtype_policies import quantization
>>> quantization.Int4QuantizationConfig(block_size=64)
Int4QuantizationConfig(block_size=64)
"""

from dtype_policies.quantization.api import quantize
from dtype_policies.quantization.kernels.epilogues import (
    compile_epilogues_enabled,
    set_compile_epilogues,
)
from dtype_policies.quantization.kinds import register_linear_kind
from dtype_policies.quantization.report import QuantizationReport
from dtype_policies.quantization.sampled_text import sampled_token_ids
from dtype_policies.quantizers.awq_config import AWQConfig
from dtype_policies.quantizers.config import (
    AbsMaxQuantizer,
    CalibratedQuantizationConfig,
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationConfig,
)
from dtype_policies.quantizers.gptq_config import GPTQConfig

__all__ = [
    "AWQConfig",
    "AbsMaxQuantizer",
    "CalibratedQuantizationConfig",
    "Float8QuantizationConfig",
    "GPTQConfig",
    "Int4QuantizationConfig",
    "Int8QuantizationConfig",
    "QuantizationConfig",
    "QuantizationReport",
    "compile_epilogues_enabled",
    "quantize",
    "register_linear_kind",
    "sampled_token_ids",
    "set_compile_epilogues",
]
