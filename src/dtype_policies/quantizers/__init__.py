"""Quantizers and quantization configs (mirror of `keras.quantizers`): pure
functions on tensors and plain settings objects, with Keras 3's conventions.

>>> import torch
>>> from dtype_policies import quantizers
>>> q, scale = quantizers.abs_max_quantize(torch.tensor([[0.5, -1.0]]), axis=-1)
>>> q, quantizers.Int4QuantizationConfig(block_size=64)
(tensor([[  63, -127]], dtype=torch.int8), Int4QuantizationConfig(block_size=64))
>>> quantizers.QUANTIZATION_MODES[:3], quantizers.DEFAULT_AMAX_HISTORY_LENGTH
(('int8', 'float8', 'int4'), 1024)
"""

from typing import Any

from dtype_policies._modes import module_attribute as _module_attribute
from dtype_policies.quantizers.awq_config import AWQConfig
from dtype_policies.quantizers.config import (
    DEFAULT_AMAX_HISTORY_LENGTH,
    AbsMaxQuantizer,
    CalibratedQuantizationConfig,
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationConfig,
    Quantizer,
    deserialize,
    deserialize_config,
    get,
    serialize,
    serialize_config,
    validate_and_resolve_config,
)
from dtype_policies.quantizers.fake_quant import fake_quant_with_min_max_vars
from dtype_policies.quantizers.gptq_config import GPTQConfig
from dtype_policies.quantizers.grouped_zero_point import abs_max_quantize_grouped_with_zero_point
from dtype_policies.quantizers.math import (
    abs_max_quantize,
    compute_float8_amax_history,
    compute_float8_dynamic_scale,
    compute_float8_scale,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    pack_int4,
    quantize_and_dequantize,
    unpack_int4,
)
from dtype_policies.quantizers.scale_search import search_grouped_int4, search_per_channel_int4
from dtype_policies.quantizers.zero_points import refine_zero_points


def __getattr__(name: str) -> Any:
    # QUANTIZATION_MODES: the implemented modes, a tuple read from the mode records.
    return _module_attribute(__name__, name)


__all__ = [
    "DEFAULT_AMAX_HISTORY_LENGTH",
    "QUANTIZATION_MODES",
    "AWQConfig",
    "AbsMaxQuantizer",
    "CalibratedQuantizationConfig",
    "Float8QuantizationConfig",
    "GPTQConfig",
    "Int4QuantizationConfig",
    "Int8QuantizationConfig",
    "QuantizationConfig",
    "Quantizer",
    "abs_max_quantize",
    "abs_max_quantize_grouped_with_zero_point",
    "compute_float8_amax_history",
    "compute_float8_dynamic_scale",
    "compute_float8_scale",
    "dequantize_grouped",
    "deserialize",
    "deserialize_config",
    "fake_quant_with_min_max_vars",
    "get",
    "grouped_quantize_with_zero_point",
    "pack_int4",
    "quantize_and_dequantize",
    "refine_zero_points",
    "search_grouped_int4",
    "search_per_channel_int4",
    "serialize",
    "serialize_config",
    "unpack_int4",
    "validate_and_resolve_config",
]
