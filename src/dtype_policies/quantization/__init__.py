"""Quantization: configs, the model-level `quantize`, reports, and the math.

>>> from dtype_policies import quantization
>>> quantization.Int4QuantizationConfig(block_size=64)
Int4QuantizationConfig(block_size=64)
"""

from dtype_policies.quantization.config import (
    AbsMaxQuantizer,
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationConfig,
)
from dtype_policies.quantization.kernels import set_compile_epilogues
from dtype_policies.quantization.report import QuantizationReport

__all__ = [
    "AbsMaxQuantizer",
    "Float8QuantizationConfig",
    "Int4QuantizationConfig",
    "Int8QuantizationConfig",
    "QuantizationConfig",
    "QuantizationReport",
    "set_compile_epilogues",
]
